"""The one redaction function: no secret leaves the process.

Everything Shardline writes where others read it goes through `redact` (objects) or `redact_text`
(messages): MLflow params, tags and artifacts, the config stored beside a run, Prefect flow
parameters (a `PipelineConfig` serialized to JSON is redacted unless the caller asks for its secrets:
`model_dump(mode="json", context=KEEP_SECRETS)`), cached results and files under the storage root, the
CLI's output and error messages, the doctor's report.

What counts as a secret, by its name or its place, never by its value alone (a bucket or a path that
happens to equal some credential's value stays readable):
- the user:password (or token) part of a URL: `postgresql://user:pass@host/db` -> `postgresql://***@host/db`;
- a URL's signing query parameters (`X-Amz-Signature`, `X-Amz-Credential`, `X-Amz-Security-Token`, `sig`,
  `signature`, `token`, `access_token`): a presigned URL's;
- every value of an `env` mapping (`compute.job_variables.env`: a job's environment holds credentials under
  any name, `DB_PASS` as well as `RUN_LABEL`);
- the value of any key whose name says credential (`SECRET`, `PASSWORD` also inside a word as in
  `PGPASSWORD`, `PASS`, `TOKEN`, `API_KEY`, `ACCESS_KEY`, `CREDENTIAL`, `PRIVATE`, `AUTH`, `CONNECTION_STRING`,
  `PAT`, `SIG`, and an environment-style upper-case name ending in `_KEY`: `WANDB_KEY`, `AZURE_STORAGE_KEY`):
  in mappings, and in text as `NAME=value` or `NAME: value`;
- in text, the value of such an environment variable of this process, when it is long enough to be a
  real credential (16 characters or more: a short value like `test` is left alone, it would mask
  ordinary words).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import traceback
from typing import Any

MASK = "***"
KEEP_SECRETS = {"secrets": "keep"}  # the serialization context that keeps a config's secrets (never written)

# whole words of a name (split at _ . - and camelCase): `max_tokens` or `tokenizer` or `author` are not secrets
_SECRET_WORDS = {
    "secret", "password", "passwd", "pass", "pwd", "token", "credential", "credentials", "apikey", "private", "auth",
    "pat", "sig", "signature",
}  # fmt: skip
_SECRET_PAIRS = {("api", "key"), ("access", "key"), ("private", "key"), ("client", "secret"), ("connection", "string")}
_SIGNED_QUERY = re.compile(
    r"(?P<name>[?&](?:X-Amz-Signature|X-Amz-Credential|X-Amz-Security-Token|sig|signature|token|access_token)=)"
    r"(?P<value>[^&#\s'\"]+)",
    re.IGNORECASE,
)
# `scheme://user:pass@`, and `http:/user:pass@`, a server's URL that went through a path (`Path` collapses `//`);
# not `models:/name@alias`, an MLflow model's URI
URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://|\bhttps?:/)(?P<userinfo>[^/@\s'\"]+)@")
_ERROR_CLASS = re.compile(r"[a-z](Error|Exception|Warning)$")  # an exception's class before its message
_ASSIGNMENT = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_.-]*)(?P<sep>['\"]?\s*[:=]\s*['\"]?)(?P<value>[^\s'\",;}\]&]+)")
MIN_ENV_SECRET = 16
# the shell's own variables whose names read as credentials: the working directories (`pwd`) and ssh-agent's socket
# (`auth`). Masked, every path under the folder a user runs from read `***/...` (configs, errors, the run's files)
_SHELL_PATHS = {"PWD", "OLDPWD", "SSH_AUTH_SOCK"}


def is_secret_name(name: str) -> bool:
    words = [w.lower() for w in re.split(r"[_.\-\s]+|(?<=[a-z])(?=[A-Z])", name) if w]
    if any(w in _SECRET_WORDS or "passw" in w for w in words) or any(p in _SECRET_PAIRS for p in zip(words, words[1:])):
        return True
    # an environment variable's KEY (`WANDB_KEY`, `OPENAI_KEY`): not a setting's (`sequence_key`, `cache_key`)
    return len(words) > 1 and words[-1] == "key" and name.isupper()


def _environ() -> list[tuple[str, str]]:
    """This process's environment, read while other threads may change it: MLflow's telemetry sets and
    deletes a variable of its own, and a key deleted between `os.environ`'s listing and its lookup is a
    KeyError (seen as a failed training run). Read again until one reading holds."""
    for _ in range(10):
        try:
            return list(os.environ.items())
        except (KeyError, RuntimeError):
            continue
    return [(k, v) for k in list(os.environ) if (v := os.environ.get(k)) is not None]


def _env_secrets() -> list[str]:
    return sorted(
        (v for k, v in _environ() if v and len(v) >= MIN_ENV_SECRET and k not in _SHELL_PATHS and is_secret_name(k)),
        key=len,
        reverse=True,
    )


def _assignments(text: str) -> str:
    """`NAME=value` and `NAME: value` with a credential's name masked; a value that is itself such a pair
    (`failed: DB_PASS=...`) is looked into."""

    def one(m: re.Match) -> str:
        if is_secret_name(m["name"]) and not _ERROR_CLASS.search(m["name"]):  # `NoCredentialsError: Unable to ...`
            return f"{m['name']}{m['sep']}{MASK}" if m["value"] != MASK else m[0]
        return f"{m['name']}{m['sep']}{_assignments(m['value'])}"

    return _ASSIGNMENT.sub(one, text)


def redact_text(text: str) -> str:
    """`text` with URL userinfo, `SECRET_NAME=value` pairs and this process's credential values masked."""
    if not text:
        return text
    text = URL_USERINFO.sub(lambda m: f"{m['scheme']}{MASK}@", text)
    text = _SIGNED_QUERY.sub(lambda m: f"{m['name']}{MASK}", text)
    text = _assignments(text)
    for value in _env_secrets():
        if value in text:
            text = text.replace(value, MASK)
    return text


def redact(obj: Any) -> Any:
    """A copy of `obj` (JSON-like: dicts, lists, strings) with every secret masked (see the module)."""
    if isinstance(obj, dict):
        return {
            k: (
                {name: MASK if value not in (None, "") else value for name, value in v.items()}
                if k == "env" and isinstance(v, dict)  # a job's environment: every value a secret
                else MASK
                if is_secret_name(str(k)) and v not in (None, "") and not isinstance(v, dict)
                else redact(v)
            )
            for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact(v) for v in obj)
    if isinstance(obj, str):
        return redact_text(obj)
    return obj


def has_masked_userinfo(url: str | None) -> bool:
    """Whether `url` is a redacted URL (its credentials were taken out before it was passed on)."""
    return bool(url) and f"://{MASK}@" in url


def without_userinfo(url: str) -> str:
    return URL_USERINFO.sub(lambda m: m["scheme"], url)


class RedactingFilter(logging.Filter):
    """Masks secrets in every record a handler emits (the console, Prefect's API log handler): the message,
    its arguments and its traceback text."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is left to the handler
            return True
        clean = redact_text(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
            record.exc_text = redact_text("".join(traceback.format_exception(*record.exc_info)).rstrip("\n"))
        elif record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        return True


_FILTER = RedactingFilter()


class RedactingStream:
    """stdout/stderr with secrets masked in what is written (libraries print too: MLflow writes its
    "View run at <tracking URI>" links straight to sys.stdout)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(redact_text(text))
        return len(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def install_log_redaction() -> None:
    """Put the redacting filter on every handler of the root and Prefect's loggers, and wrap stdout and
    stderr (idempotent); the CLI and each flow call it, so that a worker's process redacts too."""
    for name in ("", "prefect", "prefect.flow_runs", "prefect.task_runs", "shardline"):
        for handler in logging.getLogger(name).handlers:
            if _FILTER not in handler.filters:
                handler.addFilter(_FILTER)
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, RedactingStream):
            setattr(sys, name, RedactingStream(stream))


def redact_exception(error: BaseException) -> BaseException:
    """`error` (and the errors it was raised from) with secrets masked in place: its arguments, an OSError's
    strerror and filename, a `message` attribute (MLflow's), its notes. The type and traceback stay, so a retry
    policy that reads the type still reads it; the message a failed state, a log or a stored record gets is clean."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        try:
            error.args = tuple(redact_text(a) if isinstance(a, str) else a for a in error.args)
            for attr in ("strerror", "filename", "filename2", "message", "msg"):
                value = getattr(error, attr, None)
                if isinstance(value, str):
                    setattr(error, attr, redact_text(value))
            if isinstance(getattr(error, "__notes__", None), list):
                error.__notes__ = [redact_text(n) if isinstance(n, str) else n for n in error.__notes__]
        except (AttributeError, TypeError):  # an error that keeps its message read-only: left as it is
            pass
        error = error.__cause__ or error.__context__
    return error


def redacted_errors(fn):
    """`fn` whose errors leave it with their secrets masked (`redact_exception`): the boundary of every Prefect
    task and flow of Shardline's, so that a failed state's message, its stored record and its logs hold none. An
    object store it could not connect to leaves it as a `StorageUnreachable` naming the endpoint."""
    import functools
    import inspect

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BaseException as e:
            from shardline.core.unreachable import unreachable

            redact_exception(e)
            if (said := unreachable(e)) is not None:  # botocore's raw account, as what to check
                redact_exception(said)
                raise said from e
            raise

    # the parameters' types resolved where `fn` is defined (Prefect validates a flow's parameters from them, and a
    # postponed annotation would otherwise be looked up in this module)
    wrapper.__signature__ = inspect.signature(fn, eval_str=True)
    wrapper.__annotations__ = inspect.get_annotations(fn, eval_str=True)
    return wrapper


def job_variables_here(job_variables: dict) -> dict:
    """A job's variables as this process has them. Every value of a job's environment is masked in the config a
    flow run is handed (its parameters are stored in the Prefect API); where this process runs that job (a worker
    set its environment from the job's variables), a masked value is this process's own, passed on to the runs it
    starts (a training's other nodes). A value this process does not have stays masked."""
    env = job_variables.get("env") if isinstance(job_variables, dict) else None
    if not env:
        return job_variables
    own = {k: os.environ[k] if v == MASK and k in os.environ else v for k, v in env.items()}
    return {**job_variables, "env": own}
