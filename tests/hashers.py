"""A password hasher for the test process only.

Django's PBKDF2 hasher runs over a million iterations (about 0.7 s of CPU
per password on this 2-core machine, several seconds under load); fixtures
create users for nearly every test. This one is the same algorithm with one
iteration, so its hashes keep the ``pbkdf2_sha256$1$…`` form that the
processes the end-to-end tests start (web server, workers, with Django's
own hashers) verify as usual."""

from django.contrib.auth.hashers import PBKDF2PasswordHasher


class OneIterationPBKDF2PasswordHasher(PBKDF2PasswordHasher):
    iterations = 1
