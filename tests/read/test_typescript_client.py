"""A frontend's typed client of the API (R-API-1, R-READ-6): the OpenAPI
document, as the server serves it, turned into TypeScript types with
``openapi-typescript`` and compiled with ``tsc --noEmit --strict``, with a
small client that reads what a chat page reads (threads, a submit and its
errors, history with its feedback, runs of a thread, a webhook).

Needs ``npm`` (the packages are installed into ``var/cache/ts-client`` the
first time, then reused); without it, or when the registry cannot be
reached, the test is skipped and says why. A compile error fails it: the
schema would have stopped matching what a TypeScript frontend expects.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from django.test import Client

from core.config import BASE_DIR

pytestmark = [pytest.mark.typescript, pytest.mark.django_db]

# The versions the client is checked with (npm resolves them once; the
# cache keeps them).
PACKAGES = ["openapi-typescript@7.13.0", "typescript@5.9.3"]
CACHE = Path(BASE_DIR) / "var" / "cache" / "ts-client"

# What a frontend writes against the generated types. Every name here is
# one a client relies on: a change of the schema that breaks one of them
# fails to compile.
CLIENT = """
import type { components, paths } from "./api";

type Json<P extends keyof paths, M extends keyof paths[P], S extends number> =
  paths[P][M] extends { responses: { [K in S]: { content: { "application/json": infer B } } } } ? B : never;

type ThreadPage = Json<"/api/threads", "get", 200>;
type History = Json<"/api/threads/{thread_id}/history", "get", 200>;
type Runs = Json<"/api/threads/{thread_id}/runs", "get", 200>;
type Submitted = Json<"/api/threads/{thread_id}/runs", "post", 202>;
type Refused = Json<"/api/threads/{thread_id}/runs", "post", 409>;
type RunIn = paths["/api/threads/{thread_id}/runs"]["post"]["requestBody"]["content"]["application/json"];

export function titles(page: ThreadPage): string[] {
  return page.items.map((thread) => thread.title ?? "");
}

export function ratings(history: History): Array<"like" | "dislike" | null> {
  return history.items.map((item) => (item.kind === "answer" ? item.feedback?.rating ?? null : null));
}

export function turnCost(runs: Runs, turnId: string): number | null {
  let total = 0;
  for (const run of runs.items) {
    if (run.turn_id !== turnId) continue;
    const usd = run.cost?.total_usd;
    if (usd === null || usd === undefined) return null;
    total += Number(usd);
  }
  return total;
}

export function submission(text: string, hook: string): RunIn {
  return { request_id: crypto.randomUUID(), input: { text }, multitask_strategy: "rollback", webhook: hook };
}

export function runId(answer: Submitted): string {
  return answer.run_id;
}

export function busy(answer: Refused): string {
  return answer.error.code;
}

export type Error = components["schemas"]["ErrorOut"];
"""


def _npm() -> str:
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("the TypeScript client check needs npm (apt-get install npm)")
    return npm


def _installed(npm: str) -> Path:
    """The cache directory with both packages installed."""
    bins = CACHE / "node_modules" / ".bin"
    if not ((bins / "openapi-typescript").exists() and (bins / "tsc").exists()):
        CACHE.mkdir(parents=True, exist_ok=True)
        (CACHE / "package.json").write_text('{"private": true}\n')
        done = subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", "--loglevel=error", *PACKAGES],
            cwd=CACHE,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode != 0:
            pytest.skip(f"npm could not install {', '.join(PACKAGES)}: {done.stderr.strip()[-500:]}")
    return bins


def _run(args: list, cwd: Path) -> None:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(map(str, args))}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"


def test_the_openapi_document_makes_a_typescript_client_that_compiles_strictly_R_API_1_R_READ_6(tmp_path):
    bins = _installed(_npm())
    document = Client().get("/api/openapi.json")
    assert document.status_code == 200
    (tmp_path / "openapi.json").write_text(json.dumps(document.json()))
    _run([bins / "openapi-typescript", "openapi.json", "--output", "api.d.ts"], tmp_path)
    (tmp_path / "client.ts").write_text(CLIENT)
    _run(
        [
            bins / "tsc",
            "--noEmit",
            "--strict",
            "--target",
            "es2022",
            "--lib",
            "es2022,dom",
            "--module",
            "es2022",
            "--moduleResolution",
            "bundler",
            "client.ts",
        ],
        tmp_path,
    )
