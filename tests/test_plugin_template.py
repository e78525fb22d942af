"""plugin_template/ is a working third-party package: copied to a temp folder and pip-installed into this
environment, infer lists its component, `infer --plugin slru generate` uses it, and its own test suite passes.

The package is uninstalled at the end (unless it was installed before the test started).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

TEMPLATE = Path(__file__).resolve().parents[1] / "plugin_template"
DIST = "infer-plugin-example"
SHARED = "You are a careful assistant for Python questions. Answer briefly, show one example, and name the module. "
BURST = [f"Flood request {w}: explain how {w}_handler parses the {w} configuration file and reports errors. "
         for w in ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot")]


def _installed() -> bool:
    try:
        metadata.distribution(DIST)
    except metadata.PackageNotFoundError:
        return False
    return True


def _pip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pip", *args, "-q", "--disable-pip-version-check"],
                          capture_output=True, text=True, timeout=300)


def _build_isolation_args() -> list[str]:
    """Build with the environment's setuptools when it can make wheels by itself (fast, offline); else let pip
    fetch the build requirements into an isolated environment."""
    try:
        version = tuple(int(part) for part in metadata.version("setuptools").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return []
    has_wheel = version >= (70, 1) or _has("wheel")
    return ["--no-build-isolation"] if version >= (64, 0) and has_wheel else []


def _has(dist: str) -> bool:
    try:
        metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        return False
    return True


def infer_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The `infer` console script of this environment, in a fresh process (it sees the new entry points)."""
    script = Path(sys.executable).with_name("infer")
    command = [str(script)] if script.exists() else [sys.executable, "-P", "-c", "from infer.cli import main; main()"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def installed_template(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    copy = tmp_path_factory.mktemp("template") / "infer-plugin-example"
    shutil.copytree(TEMPLATE, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".*cache"))
    preinstalled = _installed()
    result = _pip("install", "--no-deps", *_build_isolation_args(), str(copy))
    assert result.returncode == 0, f"pip install of the template failed:\n{result.stdout}\n{result.stderr}"
    try:
        yield copy
    finally:
        if not preinstalled:
            _pip("uninstall", "-y", DIST)


def test_infer_plugins_lists_its_component(installed_template):
    result = infer_cli("plugins", "--json")
    assert result.returncode == 0, result.stderr
    rows = {(row["kind"], row["name"]): row for row in json.loads(result.stdout)}
    assert rows[("eviction_policy", "slru")]["source"] == DIST
    assert rows[("eviction_policy", "slru")]["aliases"] == ["segmented-lru"]


def test_generate_with_the_plugin_uses_it(installed_template, tiny_model):
    """A shared prompt, reused once, then a burst of one-off prompts in a small KV pool: with the plugin's slru the
    shared prompt's blocks survive the burst (a higher prefix hit rate than lru's)."""

    def hit_rate(*selection: str) -> float:
        result = infer_cli("--model", str(tiny_model), "--device", "cpu", "--num-kv-blocks", "8", *selection,
                           "generate", "--stream", "--stats", "--max-tokens", "1", "--ignore-eos",
                           SHARED + "Question 1?", SHARED + "Question 2?", *BURST, SHARED + "Question 3?")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stderr[result.stderr.index("{"):])["prefix_hit_rate"]

    assert hit_rate("--plugin", "slru") > hit_rate("--eviction-policy", "lru") > 0


def test_the_template_test_suite_passes(installed_template):
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                            cwd=installed_template, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert " passed" in result.stdout and "failed" not in result.stdout
