"""Every code block of README.md, docs/*.md and BENCHMARKS.md runs as written, and every command
in a config's header comment (configs/*.yaml) does what it says.

A block runs by its language:

* ``python``: executed as a script, in this process (in a fresh namespace, in a temporary
  working directory, with no ``KERAS_BACKEND`` in ``os.environ``), or in a process of its own
  with a reader's environment (``command_env``: no ``KERAS_BACKEND``, which this process has
  since the suite imported jaxdist) when it uses Keras (a block must choose Keras's backend
  itself), or, under a ``<!-- run under: COMMAND -->`` annotation, as a script file passed to
  that command (``python -m jaxdist.launch --workers 2 -- python`` + the file) in a
  subprocess;
* ``bash`` / ``sh`` / unlabelled: every command line (``\\`` continuations joined, ``#``
  comments dropped) must be ``[VAR=value ...] python ...``; each runs in a subprocess in a
  new temporary directory that holds the repository's ``configs/`` and ``tests/`` and must
  exit 0. An identical command in several blocks runs once (and a config header's line that is
  one of them shares its run);
* ``json``: parsed (one document, or JSON lines); a ``TF_CONFIG`` (one with ``"cluster"``) is
  read by ``TFConfigClusterResolver``;
* ``yaml``: a config section; merged into ``configs/default.yaml`` and validated by the job
  config loader.

Annotations are HTML comments on the lines just above a block (invisible on GitHub, visible in
the source):

* ``<!-- not run: REASON -->``: the block cannot run here (``pip install``, Kubernetes,
  output listings, diagrams, another library's code); counted and listed, never silent;
* ``<!-- name: NAME -->`` / ``<!-- run after: NAME -->``: a python block that continues the
  block named NAME (earlier in the same file) runs after it, in one namespace;
* ``<!-- run under: COMMAND -->``: see above (a block that needs a cluster).

A block that is not marked and does not run fails the test naming its file and line. Every
relative link of these files names a file of the repository (and, with ``#anchor``, one of its
headings), and the README links nothing outside the repository.

The commands (shell blocks, blocks under a cluster, config headers) of the selected tests start
in one background thread, in test order, when the module's first test starts, so they run while
this process runs the in-process blocks; a test whose command has not started yet runs it
itself. ``JAXDIST_DOC_PREFETCH=0`` runs each command in its own test instead.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import threading
from collections.abc import Callable

import pytest
from devutil import xla_flags

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "BENCHMARKS.md"]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
COMMAND_TIMEOUT = 240  # seconds per documented command (a launcher job takes ~20 s on 2 cores)
# Documented commands run in a background thread ahead of their tests (one at a time, while this
# process runs the in-process blocks or waits on another command): 2 cores, 2 streams of work.
# JAXDIST_DOC_PREFETCH=0 runs every command in its own test, in order.
PREFETCH = os.environ.get("JAXDIST_DOC_PREFETCH", "1") != "0"

_FENCE = re.compile(r"^(```+)\s*([\w+-]*)\s*$")
_NOTE = re.compile(r"^<!--\s*(not run|name|run after|run under)\s*:\s*(.*?)\s*-->\s*$")
SHELL = {"bash", "sh", "shell", "console", ""}


@dataclasses.dataclass
class Block:
    path: pathlib.Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    notes: dict[str, str]

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def parse_blocks(path: pathlib.Path) -> list[Block]:
    """The fenced blocks of a markdown file with the annotations just above each."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        notes, k = {}, i - 1
        while k >= 0 and (not lines[k].strip() or _NOTE.match(lines[k].strip())):
            n = _NOTE.match(lines[k].strip())
            if n:
                notes.setdefault(n.group(1), n.group(2))
            k -= 1
        end = i + 1
        while end < len(lines) and not lines[end].startswith(m.group(1)):
            end += 1
        if end == len(lines):
            raise AssertionError(f"{path}:{i + 1}: code block never closed")
        blocks.append(Block(path, i + 1, m.group(2).lower(), "\n".join(lines[i + 1:end]) + "\n",
                            notes))
        i = end + 1
    return blocks


ALL_BLOCKS = [b for p in DOCS for b in parse_blocks(p)]
RUN_BLOCKS = [b for b in ALL_BLOCKS if "not run" not in b.notes]


def shell_commands(code: str) -> list[str]:
    """The logical command lines of a shell block (continuations joined, comments dropped)."""
    out, cur = [], ""
    for raw in code.splitlines():
        line = raw.rstrip()
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        # a trailing comment after the command (`cmd   # what it does`)
        out.append(" ".join(re.sub(r"\s+#\s.*$", "", cur).split()))
        cur = ""
    if cur:
        out.append(cur.strip())
    return out


def split_command(cmd: str) -> tuple[dict[str, str], list[str]]:
    """``VAR=value ... python args`` -> (env, argv); raises ValueError for anything else."""
    words = shlex.split(cmd)
    env = {}
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if not words or words[0] not in ("python", "python3"):
        raise ValueError(f"{cmd!r} is not a `python ...` command")
    if any(w in ("|", "&&", "||", ";", ">", "<") or w.startswith(("[", "$(")) for w in words):
        raise ValueError(f"{cmd!r} is not one plain command (a pipe, a redirection or a "
                         f"[placeholder])")
    return env, [sys.executable, *words[1:]]


def command_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a reader's shell has: this repository importable, `python` on PATH,
    JAX on the CPU (as the suite), no forced device count (the command sets its own); of the
    suite's XLA flags only its optimisation level (tests/conftest.py) goes along."""
    env = dict(_READER_ENV or os.environ)
    # No KERAS_BACKEND either: a documented program chooses its backend itself (importing
    # jaxdist before keras selects JAX), as it must in a reader's shell.
    for key in ("JAX_NUM_CPU_DEVICES", "TF_CONFIG", "JAXDIST_CLUSTER_TOKEN", "KERAS_BACKEND"):
        env.pop(key, None)
    env["XLA_FLAGS"] = xla_flags()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env.update(extra or {})
    return env


# The environment when this module's first test starts: an in-process block that sets a
# variable (os.environ.setdefault("KERAS_BACKEND", ...)) does not leak into the commands.
_READER_ENV: dict[str, str] = {}


def work_dir(tmp: pathlib.Path) -> pathlib.Path:
    """A working directory with the repository's configs/ and tests/ (what the commands name)."""
    for name in ("configs", "tests", "benchmarks"):
        link = tmp / name
        if not link.exists():
            link.symlink_to(ROOT / name)
    return tmp


def run_command(cmd: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    env, argv = split_command(cmd)
    return subprocess.run(argv, cwd=cwd, env=command_env(env), capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT, stdin=subprocess.DEVNULL)


def _fail_output(what: str, proc: subprocess.CompletedProcess) -> str:
    tail = (proc.stdout + proc.stderr)[-4000:]
    return f"{what} exited {proc.returncode}:\n{tail}"


class Runs:
    """Each documented job (a command, a header's lines) runs once, by key; jobs submitted ahead
    run in one background thread, in order. Asking for a job that has not started yet runs it
    in the asking thread instead, so nothing waits on a queue."""

    def __init__(self, tmp_path_factory):
        self._tmp = tmp_path_factory
        self._lock = threading.Lock()
        self._jobs: dict[object, concurrent.futures.Future] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="doc-command")

    def fresh_dir(self) -> pathlib.Path:
        """A new working directory: the command runs as on a fresh checkout (no earlier run's
        checkpoint to resume)."""
        return work_dir(self._tmp.mktemp("doc-command"))

    def submit(self, key, fn: Callable[[], object]) -> None:
        with self._lock:
            if key not in self._jobs:
                self._jobs[key] = self._pool.submit(fn)

    def get(self, key, fn: Callable[[], object]):
        with self._lock:
            job = self._jobs.get(key)
            if job is None or job.cancel():  # not started: run it here
                job = self._jobs[key] = concurrent.futures.Future()
                job.set_running_or_notify_cancel()
                mine = True
            else:
                mine = False
        if mine:
            try:
                job.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to every asker
                job.set_exception(e)
        return job.result()

    def shell(self, cmd: str) -> subprocess.CompletedProcess:
        """A documented command in a fresh directory; an identical command runs once."""
        return self.get(cmd, lambda: run_command(cmd, self.fresh_dir()))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module", autouse=True)
def runs(request, tmp_path_factory):
    """The module's documented jobs; with PREFETCH, those of the selected tests are submitted
    when the module's first test starts, in test order (they run while the in-process blocks
    do)."""
    _READER_ENV.clear()
    _READER_ENV.update(os.environ)
    r = Runs(tmp_path_factory)
    if PREFETCH:
        for item in request.session.items:
            if item.module is not sys.modules[__name__] or not hasattr(item, "callspec"):
                continue
            name, params = item.originalname, item.callspec.params
            if name == "test_python_block_under_a_cluster":
                block = params["block"]
                if not _continued_later(block):
                    r.submit(("cluster", block.id), lambda b=block: _run_under_cluster(b, r))
            elif name == "test_python_block" and _in_own_process(params["block"]):
                block = params["block"]
                r.submit(("own process", block.id), lambda b=block: _run_in_own_process(b, r))
            elif name == "test_shell_block":
                for cmd in shell_commands(params["block"].code):
                    r.submit(cmd, lambda c=cmd: run_command(c, r.fresh_dir()))
            elif name == "test_config_header_commands_do_what_they_say":
                config = params["config"]
                r.submit(("header", config.name), lambda c=config: _run_header(c, r))
    yield r
    r.close()


def _is_slow(block: Block) -> bool:
    """Blocks that start processes: marked `slow` (CI's main pass runs them; the one-device pass
    skips them, as their processes set their own devices)."""
    multi_process = any(s in block.code for s in ("jaxdist.launch", "LocalCluster"))
    return multi_process or "run under" in block.notes or block.lang in SHELL


def _params(blocks):
    return [pytest.param(b, id=b.id, marks=[pytest.mark.slow] if _is_slow(b) else [])
            for b in blocks]


# ------------------------------------------------------------------ the inventory

def test_every_block_runs_or_is_marked():
    """Each block is of a kind this file runs, or carries `<!-- not run: REASON -->`."""
    problems = []
    names = {}
    for b in ALL_BLOCKS:
        if "not run" in b.notes:
            if not b.notes["not run"]:
                problems.append(f"{b.id}: `not run` without a reason")
            if b.lang == "python":  # not run, but valid Python that can be pasted
                try:
                    compile(b.code, b.id, "exec")
                except SyntaxError as e:
                    problems.append(f"{b.id}: not valid Python: {e}")
            continue
        if "name" in b.notes:
            names[(b.path, b.notes["name"])] = b
        if "run after" in b.notes and (b.path, b.notes["run after"]) not in names:
            problems.append(f"{b.id}: runs after {b.notes['run after']!r}, which no earlier "
                            f"block of {b.path.name} is named")
        if b.lang in ("python", "json", "yaml"):
            continue
        if b.lang in SHELL:
            try:
                cmds = shell_commands(b.code)
                if not cmds:
                    raise ValueError("no command")
                for c in cmds:
                    split_command(c)
            except ValueError as e:
                problems.append(f"{b.id}: {e}; fix the block or mark it <!-- not run: ... -->")
            continue
        problems.append(f"{b.id}: a {b.lang!r} block cannot be run; mark it <!-- not run: ... -->")
    assert not problems, "\n".join(problems)


def test_inventory_is_reported(capsys):
    """Prints the counts (`pytest -s -k inventory`): blocks found, run, marked not run."""
    not_run = [b for b in ALL_BLOCKS if "not run" in b.notes]
    with capsys.disabled():
        print(f"\ndoc blocks: {len(ALL_BLOCKS)} found, {len(ALL_BLOCKS) - len(not_run)} run, "
              f"{len(not_run)} marked not run")
        for b in not_run:
            print(f"  not run  {b.id}: {b.notes['not run']}")
    assert ALL_BLOCKS


# ------------------------------------------------------------------ links

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def heading_anchors(path: pathlib.Path) -> set[str]:
    """The anchors GitHub gives a markdown file's headings (outside code blocks)."""
    anchors, seen, fence = set(), {}, None
    for line in path.read_text().splitlines():
        m = _FENCE.match(line)
        if m and (fence is None or line.startswith(fence)):
            fence = None if fence else m.group(1)
            continue
        h = None if fence else re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if h:
            slug = re.sub(r"[^\w\- ]", "", h.group(1).lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def doc_links(path: pathlib.Path) -> list[str]:
    """The link targets of a markdown file's text (code blocks and inline code left out)."""
    text = re.sub(r"^(```+).*?^\1", "", path.read_text(), flags=re.S | re.M)
    return _LINK.findall(re.sub(r"`[^`\n]*`", "", text))


def test_links_resolve():
    """Every relative link of README.md, docs/*.md and BENCHMARKS.md names a file of the
    repository and, with `#anchor`, one of its headings; the README links nothing outside the
    repository."""
    problems = []
    for path in DOCS:
        name = path.relative_to(ROOT)
        for target in doc_links(path):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                if path.name == "README.md":
                    problems.append(f"{name}: links outside the repository: {target}")
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                problems.append(f"{name}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest):
                problems.append(f"{name}: {target}: no such heading")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------ python blocks

def _chain(block: Block) -> list[Block]:
    chain = [block]
    while "run after" in chain[0].notes:
        want = chain[0].notes["run after"]
        prev = [b for b in RUN_BLOCKS if b.path == block.path and b.line < chain[0].line
                and b.notes.get("name") == want]
        assert prev, f"{block.id}: no earlier block named {want!r}"
        chain.insert(0, prev[-1])
    return chain


def _in_own_process(block: Block) -> bool:
    """A block that uses Keras runs in a process of its own: this one has imported Keras, on the
    JAX backend the suite's ``import jaxdist`` chose, which a reader's shell has not."""
    return any("keras" in part.code for part in _chain(block))


def _run_in_own_process(block: Block, runs: Runs) -> tuple[str, subprocess.CompletedProcess]:
    """``block`` (after the blocks it continues) as a script, run by ``python`` in a reader's
    environment with this session's device count."""
    cwd = runs.fresh_dir()
    script = cwd / "doc_block.py"
    script.write_text("".join(p.code for p in _chain(block)))
    devices = _READER_ENV.get("JAX_NUM_CPU_DEVICES")
    cmd = (f"JAX_NUM_CPU_DEVICES={devices} " if devices else "") + f"python {script.name}"
    return cmd, run_command(cmd, cwd)


@pytest.mark.parametrize("block", _params(
    [b for b in RUN_BLOCKS if b.lang == "python" and "run under" not in b.notes]))
def test_python_block(block, tmp_path, monkeypatch, runs):
    if "topology=" in block.code and importlib.util.find_spec("libtpu") is None:
        pytest.skip("compiles for a TPU topology: needs libtpu (pip install -e '.[tpu]')")
    if _in_own_process(block):
        cmd, proc = runs.get(("own process", block.id), lambda: _run_in_own_process(block, runs))
        assert proc.returncode == 0, _fail_output(f"{block.id} as {cmd!r}", proc)
        return
    # a reader's environment: the suite's KERAS_BACKEND (set by its `import jaxdist`) is not
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    chain = _chain(block)
    # A continued block runs in the namespace and directory its named block left (as the next
    # cell of a notebook) when that block ran in this session; else the chain runs from the top.
    cwd, namespace = _NAMESPACES.get((block.path, chain[0].notes.get("name")), (None, None))
    if namespace is not None and len(chain) > 1:
        chain = chain[-1:]
    else:
        cwd, namespace = tmp_path, {"__name__": "__main__"}
    monkeypatch.chdir(cwd)
    for part in chain:
        exec(compile(part.code, part.id, "exec"), namespace)  # noqa: S102 - the docs' sample
        if "name" in part.notes:
            _NAMESPACES[(part.path, part.notes["name"])] = (cwd, namespace)


_NAMESPACES: dict[tuple[pathlib.Path, str], tuple[pathlib.Path, dict]] = {}


def _continued_later(block: Block) -> Block | None:
    """The block that continues `block` under a cluster (and so runs it first), if any."""
    later = [b for b in RUN_BLOCKS if b.path == block.path and b.line > block.line
             and "run under" in b.notes and "name" in block.notes
             and b.notes.get("run after") == block.notes["name"]]
    return later[0] if later else None


def _run_under_cluster(block: Block, runs: Runs) -> tuple[str, subprocess.CompletedProcess]:
    cwd = runs.fresh_dir()
    script = cwd / "doc_block.py"
    script.write_text("".join(p.code for p in _chain(block)))
    cmd = f"{block.notes['run under']} {script.name}"
    return cmd, run_command(cmd, cwd)


@pytest.mark.parametrize("block", _params(
    [b for b in RUN_BLOCKS if b.lang == "python" and "run under" in b.notes]))
def test_python_block_under_a_cluster(block, runs):
    later = _continued_later(block)
    if later:  # one cluster for both: the continuation runs this block first
        pytest.skip(f"runs as the start of {later.id}")
    cmd, proc = runs.get(("cluster", block.id), lambda: _run_under_cluster(block, runs))
    assert proc.returncode == 0, _fail_output(f"{block.id} under {cmd!r}", proc)


def test_a_block_in_its_own_process_gets_a_readers_environment(runs):
    """The process a Keras block runs in has no KERAS_BACKEND (this process has one)."""
    assert os.environ.get("KERAS_BACKEND") == "jax"  # the suite's `import jaxdist` chose it
    block = Block(ROOT / "README.md", 0, "python",
                  'import os\nassert "KERAS_BACKEND" not in os.environ, os.environ\n', {})
    _, proc = _run_in_own_process(block, runs)
    assert proc.returncode == 0, _fail_output("a block in its own process", proc)


# ------------------------------------------------------------------ shell blocks

@pytest.mark.parametrize("block", _params(
    [b for b in RUN_BLOCKS if b.lang in SHELL]))
def test_shell_block(block, runs):
    for cmd in shell_commands(block.code):
        proc = runs.shell(cmd)
        assert proc.returncode == 0, _fail_output(f"{block.id}: {cmd!r}", proc)


# ------------------------------------------------------------------ data blocks

@pytest.mark.parametrize("block", _params(
    [b for b in RUN_BLOCKS if b.lang == "json"]))
def test_json_block(block, monkeypatch):
    try:
        doc = json.loads(block.code)
    except json.JSONDecodeError:  # JSON lines (metrics.jsonl): one object per line
        docs = [json.loads(line) for line in block.code.splitlines() if line.strip()]
        assert all(isinstance(d, dict) for d in docs), block.id
        return
    if "cluster" in doc:
        from jaxdist.cluster_resolver import TFConfigClusterResolver

        monkeypatch.setenv("TF_CONFIG", block.code)
        resolver = TFConfigClusterResolver()
        assert resolver.cluster_spec().jobs, block.id


@pytest.mark.parametrize("block", _params(
    [b for b in RUN_BLOCKS if b.lang == "yaml"]))
def test_yaml_block(block, tmp_path):
    import yaml

    from jaxdist.train import load_config

    cfg = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    cfg.update(yaml.safe_load(block.code))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    load_config(str(path))


# ------------------------------------------------------------------ config headers

def header_commands(path: pathlib.Path) -> list[str]:
    """The commands in a config's header comment (`#   python ...` lines, continued with `\\`)."""
    text = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text.append(line[1:])
    cmds, cur = [], ""
    for line in text:
        s = line.strip()
        if not cur and not re.match(r"^([A-Z_][A-Z0-9_]*=\S+\s+)*python3?\s", s):
            continue
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        cmds.append(" ".join(re.sub(r"\s+#\s.*$", "", cur + s).split()))
        cur = ""
    return cmds


def _val_accuracy(output: str) -> float:
    m = re.findall(r"\[end\] .*val_accuracy=([0-9.]+)", output)
    return float(m[-1]) if m else -1.0


def _trained(out: str) -> bool:
    return "[train]" in out


# What each header command claims, checked on its output (exit code, then a predicate). A
# command not listed must exit 0 and train (a resumed, finished run trains nothing); it runs
# for one epoch (`--set train.epochs=1` appended: the claim holds as well, and a line that
# would resume the line before it still trains nothing). The commands whose claims need every
# epoch (an accuracy) run as written; the docs run them too, and their runs are shared.
FULL = {("default.yaml", 0), ("default.yaml", 1), ("multi_worker.yaml", 0),
        ("multi_worker.yaml", 1)}
HEADER_CLAIMS = {
    ("default.yaml", 0): (0, lambda out: _trained(out) and _val_accuracy(out) >= 0.95,
                          "trains and reaches >= 95% validation accuracy"),
    ("default.yaml", 1): (0, lambda out: re.search(r"\[end\] step \d+ epoch=5 ", out),
                          "trains 5 epochs"),
    ("mirrored.yaml", 1): (0, lambda out: _trained(out) and "with 4 replica(s)" in out,
                           "trains on 4 CPU replicas"),
    ("one_device.yaml", 1): ("gpu", _trained, "trains on the GPU"),
    ("multi_worker.yaml", 0): (0, lambda out: _trained(out) and _val_accuracy(out) >= 0.95,
                               "trains to about 97% validation accuracy (>= 95%)"),
    ("multi_worker.yaml", 1): (0, lambda out: _trained(out)
                               and "evaluated the final checkpoint" in out,
                               "trains, and the evaluator evaluates the final checkpoint"),
    ("tpu.yaml", 0): ("no tpu", lambda out: "no TPU" in out, "exits 1 with 'no TPU: ...'"),
    ("tpu.yaml", 2): ("libtpu", lambda out: "HBM" in out, "prints per-chip memory"),
}


def test_config_headers_name_commands():
    assert {p.name for p in CONFIGS if not header_commands(p)} == {"kubeflow_tfjob.yaml"}


# The commands of the documents' shell blocks (a header line that is one of them shares its run).
DOC_COMMANDS = {c for b in RUN_BLOCKS if b.lang in SHELL for c in shell_commands(b.code)}


def _run_header(config: pathlib.Path, runs: Runs) -> list[tuple]:
    """Runs the header's commands, in order, in one directory (as a reader runs them), up to
    the first that does not do what it says; (command, expected exit, check, claim, process)
    for each line run."""
    import jax
    import yaml

    cwd = runs.fresh_dir()
    # Without a checkpoint directory no line can resume another: each line's run is the same
    # as in a fresh directory.
    independent = (yaml.safe_load(config.read_text()).get("checkpoint") or {}).get("dir") is None
    done = []
    for i, cmd in enumerate(header_commands(config)):
        want, check, claim = HEADER_CLAIMS.get((config.name, i), (0, _trained, "trains"))
        if want == "gpu":
            if not any(d.platform == "gpu" for d in jax.devices()):
                continue  # the comment says: on a machine with a GPU
            want = 0
        elif want == "libtpu":
            if importlib.util.find_spec("libtpu") is None:
                continue  # the comment says: needs libtpu
            want = 0
        elif want == "no tpu":
            want = 1 if not any(d.platform == "tpu" for d in jax.devices()) else 0
        # A line that runs as in a fresh directory (the first line, every line of a config
        # without a checkpoint directory, a line with a checkpoint directory of its own) shares
        # the run of the same command in the docs, or runs in full once in a fresh directory.
        fresh = i == 0 or independent or "checkpoint.dir=" in cmd
        if fresh and (cmd in DOC_COMMANDS or (config.name, i) in FULL):
            proc = runs.shell(cmd)
        elif (config.name, i) in FULL:
            proc = run_command(cmd, cwd)
        else:
            proc = run_command(cmd + " --set train.epochs=1", cwd)
        done.append((cmd, want, check, claim, proc))
        if proc.returncode != want or not check(proc.stdout + proc.stderr):
            break
    return done


@pytest.mark.parametrize("config", [pytest.param(p, id=p.name, marks=[pytest.mark.slow])
                                    for p in CONFIGS if header_commands(p)])
def test_config_header_commands_do_what_they_say(config, runs):
    """The header's commands, in order, in one directory (as a reader runs them); see
    HEADER_CLAIMS for what is checked and which run one epoch."""
    lines = runs.get(("header", config.name), lambda: _run_header(config, runs))
    for cmd, want, check, claim, proc in lines:
        out = proc.stdout + proc.stderr
        assert proc.returncode == want, _fail_output(f"{config.name} line {cmd!r} "
                                                     f"(expected exit {want})", proc)
        assert check(out), (f"{config.name}: {cmd!r} should: {claim}; it printed:\n"
                            + out[-3000:])
