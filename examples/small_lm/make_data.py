"""The small_lm corpus, made on the spot from the docstrings of the Python standard library (every Python
installation holds them, so nothing is downloaded): one row per documented object of a fixed list of modules,
walked with `inspect` in sorted order, so the same Python writes the same rows.

Columns: `name` (module.object), `doc` (the whole docstring, cleaned), `summary` (its first paragraph, on one
line) and `body` (the rest; empty for a one-paragraph docstring, a row the summarizer's config skips).

    python make_data.py data/raw
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from pathlib import Path

import polars as pl

MODULES = [
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "collections", "configparser",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fractions",
    "ftplib", "functools", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html", "http.client",
    "imaplib", "inspect", "io", "ipaddress", "itertools", "json", "logging", "lzma", "mailbox", "math",
    "mimetypes", "multiprocessing", "numbers", "operator", "optparse", "os", "pathlib", "pdb", "pickle",
    "pkgutil", "platform", "plistlib", "poplib", "pprint", "queue", "random", "re", "sched", "secrets",
    "selectors", "shelve", "shlex", "shutil", "signal", "smtplib", "socket", "sqlite3", "ssl", "statistics",
    "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize",
    "trace", "traceback", "types", "typing", "unittest", "urllib.parse", "urllib.request", "uuid", "warnings",
    "wave", "weakref", "xml.dom.minidom", "zipfile", "zoneinfo",
]  # fmt: skip


def rows() -> list[dict]:
    seen: set[str] = set()  # docstrings already taken (an inherited or re-exported one appears many times)
    out = []
    for mod_name in MODULES:
        try:
            module = importlib.import_module(mod_name)
        except ImportError:  # a Python built without it (ssl, sqlite3, lzma): the corpus is smaller
            continue
        objects = [(mod_name, module)]
        for name, obj in sorted(vars(module).items()):
            # another module's objects, and modules it imported (`ast.sys`: their own docstrings, elsewhere)
            if name.startswith("_") or inspect.ismodule(obj) or getattr(obj, "__module__", mod_name) != mod_name:
                continue
            objects.append((f"{mod_name}.{name}", obj))
            if inspect.isclass(obj):
                objects += [
                    (f"{mod_name}.{name}.{m}", f) for m, f in sorted(vars(obj).items()) if not m.startswith("_")
                ]
        for qualname, obj in objects:
            doc = inspect.getdoc(obj) if callable(obj) or inspect.ismodule(obj) else None
            doc = doc.strip() if doc else ""
            if len(doc) < 20 or doc in seen:
                continue
            seen.add(doc)
            summary, _, body = doc.partition("\n\n")  # the first paragraph, on one line, and the rest
            summary = " ".join(summary.split())
            out.append({"name": qualname, "doc": doc[:2000], "summary": summary[:300], "body": body.strip()[:1000]})
    return out


def main(folder: str) -> None:
    limit = int(os.environ.get("SMALL_LM_ROWS", "0"))  # a smaller corpus (the example's test); 0: all
    frame = pl.DataFrame(rows())
    frame = frame.head(limit) if limit else frame
    Path(folder).mkdir(parents=True, exist_ok=True)
    out = Path(folder) / "docstrings.parquet"
    tmp = out.with_name(f".tmp-{out.name}")
    frame.write_parquet(tmp)
    os.replace(tmp, out)
    print(f"wrote {frame.height} docstrings of {len(MODULES)} modules to {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "data/raw")
