"""Every `SHARDLINE_*` setting the package reads is in one typed table (shardline/core/config/settings.py), read
there and nowhere else, documented in docs/config.md as that table, and a bad value fails naming the variable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardline.core.config import settings

ROOT = Path(__file__).resolve().parents[1]
READS = re.compile(r"""(?:os\.environ\.get|os\.getenv|os\.environ\[|os\.environ\.pop)\(?\s*f?["'](SHARDLINE_\w+)""")


def test_the_package_reads_shardline_variables_only_through_the_table():
    found = {}
    for path in (ROOT / "shardline").rglob("*.py"):
        if path.name == "settings.py":
            continue
        for name in READS.findall(path.read_text()):
            found.setdefault(name, []).append(path.relative_to(ROOT).as_posix())
    assert found == {}, f"read outside shardline/core/config/settings.py: {found}"


def test_every_shardline_variable_the_package_names_is_in_the_table_or_a_script_s():
    named = set()
    for path in (ROOT / "shardline").rglob("*.py"):
        named |= set(re.findall(r"\bSHARDLINE_[A-Z_]+[A-Z]\b", path.read_text()))
    scripts = {"SHARDLINE_TORCH_INDEX", "SHARDLINE_JOB"}  # ./scripts/setup's; the TrainJob's (deploy/)
    python_names = {"SHARDLINE_PACKAGE"}  # a constant in runs/model_code.py, not a variable
    assert named - set(settings.SETTINGS) - scripts - python_names == set()


def test_docs_config_lists_the_table_as_it_is():
    assert settings.table() in (ROOT / "docs" / "config.md").read_text(), "regenerate with settings.table()"


@pytest.mark.parametrize(
    "name, value, said",
    [
        (
            "SHARDLINE_PROGRESS_SECONDS",
            "soon",
            r"SHARDLINE_PROGRESS_SECONDS='soon' is not a number of seconds; set it to e\.g\. 5",
        ),
        ("SHARDLINE_RESIDENT_MB", "-1", r"SHARDLINE_RESIDENT_MB='-1' must be 0 or more \(MB\); 0: no bound"),
        ("SHARDLINE_LEASE_TTL", "2", r"SHARDLINE_LEASE_TTL='2' must be 3 or more \(seconds\)"),
        ("SHARDLINE_CACHE_MAX_GB", "0", r"SHARDLINE_CACHE_MAX_GB='0' must be more than 0 \(GB\)"),
        ("SHARDLINE_PREEMPT_AT_STEP", "1.5", r"SHARDLINE_PREEMPT_AT_STEP='1.5' is not a whole number"),
    ],
)
def test_a_bad_value_fails_naming_the_variable_and_what_it_takes(monkeypatch, name, value, said):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=said):
        settings.number(name)


def test_unset_or_empty_is_the_default_and_values_come_typed(monkeypatch, tmp_path):
    from shardline.core.storage import ShardCache

    monkeypatch.delenv("SHARDLINE_PROGRESS_SECONDS", raising=False)
    monkeypatch.setenv("SHARDLINE_CACHE_MAX_GB", " ")
    monkeypatch.setenv("SHARDLINE_CACHE", "~/somewhere")
    monkeypatch.setenv("SHARDLINE_RESIDENT_MB", "0")
    assert settings.number("SHARDLINE_PROGRESS_SECONDS") == 5.0
    assert settings.number("SHARDLINE_CACHE_MAX_GB") is None
    assert ShardCache(tmp_path).cap_source == "half the free disk: SHARDLINE_CACHE_MAX_GB is unset"
    monkeypatch.setenv("SHARDLINE_CACHE_MAX_GB", " 0.3 ")
    assert ShardCache(tmp_path).describe_cap() == "300 MB (SHARDLINE_CACHE_MAX_GB=0.3)"
    monkeypatch.setenv("SHARDLINE_CACHE_MAX_GB", " ")
    assert settings.number("SHARDLINE_RESIDENT_MB") == 0.0
    assert settings.path("SHARDLINE_CACHE") == Path.home() / "somewhere"
    with pytest.raises(KeyError):
        settings.number("SHARDLINE_NOT_A_SETTING")
