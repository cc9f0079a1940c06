"""Request ids for the logs (R-OPS-1)."""

from __future__ import annotations

import re
import uuid

from asgiref.sync import iscoroutinefunction, markcoroutinefunction

from . import logcontext

REQUEST_ID_HEADER = "X-Request-ID"
# A caller's id is kept when it is short and plain; anything else is
# replaced, so a header can never inject text into a log line.
_ACCEPTED = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def request_id_of(request) -> str:
    """The request's ``X-Request-ID`` when it is 1–128 characters of
    ``[A-Za-z0-9._:-]``, else a new random hex id."""
    supplied = request.headers.get(REQUEST_ID_HEADER, "")
    return supplied if _ACCEPTED.match(supplied) else uuid.uuid4().hex


class RequestContextMiddleware:
    """Binds ``request_id`` (and the URL's ``run_id`` / ``thread_id``) to
    every line logged while the request is handled, and answers the id in
    the ``X-Request-ID`` response header. Sync and async."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    # The ids are not unbound when the response returns: Django logs a 4xx
    # or 5xx response ("Not Found: …") after the middleware chain, and that
    # line must carry them too. Each request starts from a fresh context, so
    # nothing carries over to the next request of a thread.

    def __call__(self, request):
        if self.is_async:
            return self.__acall__(request)
        request_id = self._start(request)
        response = self.get_response(request)
        response[REQUEST_ID_HEADER] = request_id
        return response

    async def __acall__(self, request):
        request_id = self._start(request)
        response = await self.get_response(request)
        response[REQUEST_ID_HEADER] = request_id
        return response

    @staticmethod
    def _start(request) -> str:
        request_id = request_id_of(request)
        logcontext.start(request_id=request_id)
        return request_id

    def process_view(self, request, view_func, view_args, view_kwargs):
        ids = {key: view_kwargs.get(key) for key in ("run_id", "thread_id")}
        if any(ids.values()):
            logcontext.bind(**ids)
        return None
