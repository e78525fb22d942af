"""plugin_template/ is a working third-party package: copied to a temp folder and pip-installed (into a folder of
its own, put on the PYTHONPATH of the processes that use it, so that this environment and the tests running beside
these never see it), infer lists its component, `infer --plugin slru generate` uses it, and its own test suite
passes."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

TEMPLATE = Path(__file__).resolve().parents[1] / "plugin_template"
DIST = "infer-plugin-example"
SHARED = "You are a careful assistant for Python questions. Answer briefly, show one example, and name the module. "
BURST = [f"Flood request {w}: explain how {w}_handler parses the {w} configuration file and reports errors. "
         for w in ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot")]


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


def with_site(site: Path) -> dict[str, str]:
    """This process's environment with ``site`` first on the PYTHONPATH."""
    return os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}


def infer_cli(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The `infer` console script of this environment, in a fresh process that sees the packages in ``site``."""
    script = Path(sys.executable).with_name("infer")
    command = [str(script)] if script.exists() else [sys.executable, "-P", "-c", "from infer.cli import main; main()"]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=300, env=with_site(site))


@pytest.fixture(scope="module")
def installed_template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the template's copy, the folder it is installed in)."""
    root = tmp_path_factory.mktemp("template")
    copy, site = root / "infer-plugin-example", root / "site"
    shutil.copytree(TEMPLATE, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".*cache"))
    result = _pip("install", "--no-deps", "--target", str(site), *_build_isolation_args(), str(copy))
    assert result.returncode == 0, f"pip install of the template failed:\n{result.stdout}\n{result.stderr}"
    assert any(site.glob("infer_plugin_example-*.dist-info"))
    return copy, site


def test_infer_plugins_lists_its_component(installed_template):
    result = infer_cli(installed_template[1], "plugins", "--json")
    assert result.returncode == 0, result.stderr
    rows = {(row["kind"], row["name"]): row for row in json.loads(result.stdout)}
    assert rows[("eviction_policy", "slru")]["source"] == DIST
    assert rows[("eviction_policy", "slru")]["aliases"] == ["segmented-lru"]


def test_generate_with_the_plugin_uses_it(installed_template, tiny_model):
    """A shared prompt, reused once, then a burst of one-off prompts in a small KV pool: with the plugin's slru the
    shared prompt's blocks survive the burst (a higher prefix hit rate than lru's)."""

    def hit_rate(*selection: str) -> float:
        result = infer_cli(installed_template[1], "--model", str(tiny_model), "--device", "cpu", "--num-kv-blocks",
                           "8", *selection, "generate", "--stream", "--stats", "--max-tokens", "1", "--ignore-eos",
                           SHARED + "Question 1?", SHARED + "Question 2?", *BURST, SHARED + "Question 3?")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stderr[result.stderr.index("{"):])["prefix_hit_rate"]

    assert hit_rate("--plugin", "slru") > hit_rate("--eviction-policy", "lru") > 0


def test_the_template_test_suite_passes(installed_template):
    copy, site = installed_template
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=copy,
                            capture_output=True, text=True, timeout=600, env=with_site(site))
    assert result.returncode == 0, result.stdout + result.stderr
    assert " passed" in result.stdout and "failed" not in result.stdout
