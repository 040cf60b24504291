"""Making the studies' points: one run directory per point, trained by `python -m megaloop train` subprocesses in
parallel, then evaluated; skipped when already done, resumed when interrupted.

A point's run directory WORK/runs/<study>/<name> holds point.json (the point, the hash of its resolved config and
the commit, written when it starts), the trainer's files (metrics.jsonl, summary.json, checkpoints/, COMPLETED), the
evaluation (eval.json, `megaloop eval --json`), a log of the subprocesses (repro.log) and, last, done.json: the
point finished with this config hash. On a re-run a done point of the same hash is skipped; an unfinished one is
started again with the same command, and the trainer continues from the run directory's newest committed checkpoint
(megaloop.train.checkpointing); a point whose config hash changed is refused, naming the point and what to do.

Points of kind "bench" and "ragged" measure speed: they run after the training points, one at a time, so that no
other point of the study shares the cores with them.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from megaloop.config import ConfigError
from megaloop.repro.sizes import runner_overrides
from megaloop.repro.study import Point, Scale

REPO = Path(__file__).resolve().parents[2]
STOP_EXIT_CODE = 75  # as the trainer's: stopped on request, run the same command again to continue


class PointFailed(RuntimeError):
    """A point's subprocess failed for a reason other than divergence or a stop request."""


class Stopped(RuntimeError):
    """A stop signal arrived: the running points saved (or will restart); nothing else was started."""


def run_dir(scale: Scale, point: Point) -> Path:
    return scale.work / "runs" / point.study / point.name


def overrides(point: Point, scale: Scale, shards: Path) -> list[str]:
    """The point's --set list as the runner passes it (the scale's sizes first, the point's own, then its paths)."""
    sets = [*runner_overrides(scale), *point.overrides, f"data.shards={shards}"]
    return sets if point.kind != "train" else sets + [f"train.out_dir={run_dir(scale, point)}"]


# config keys added after runs were first hashed, with the default that leaves a run as it was before them
LATER_KEYS = (("train", "tokens", None), ("data", "packing", None), ("model", "doc_mask", False),
              ("model", "bos_id", None), ("model", "doc_attention_share", None))


def config_hash(point: Point, scale: Scale, shards: Path) -> str:
    """sha256 (16 hex digits) of the point's resolved config, without the paths (run directory, shards) that differ
    between work folders, plus what the runner does with it (kind, evaluation depths and rows, bench steps)."""
    from megaloop.config import load_config

    cfg = load_config(REPO / point.config, overrides(point, scale, shards), world_size=point.nproc)
    tree = cfg.to_dict()
    tree["train"].pop("out_dir", None)
    tree["train"].pop("progress", None)
    tree["data"].pop("shards", None)
    tree["train"].pop("wandb", None)  # where the records are mirrored, not what is trained
    for section, key, default in LATER_KEYS:  # at their defaults they change nothing: finished runs keep their hashes
        if tree[section].get(key, default) == default:
            tree[section].pop(key, None)
    tree["repro"] = {"kind": point.kind, "eval_depths": list(point.eval_depths), "eval_rows": point.eval_rows,
                     "bench_steps": point.bench_steps, "nproc": point.nproc}
    if point.eval_tasks != "val":  # only where it differs, so that the corpus points keep their hashes
        tree["repro"]["eval_tasks"] = point.eval_tasks
    return hashlib.sha256(json.dumps(tree, sort_keys=True, default=str).encode()).hexdigest()[:16]


def git_commit() -> dict:
    """The checkout's commit and whether tracked files differ from it."""
    def git(*args):
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "HEAD") or "unknown"
    return {"commit": commit, "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


@dataclass
class Plan:
    """What the runner will do with one point."""

    point: Point
    dir: Path
    hash: str
    state: str  # done | new | resume (a checkpoint to continue from) | restart (started, nothing committed)


def plan_point(point: Point, scale: Scale, shards: Path) -> Plan:
    d = run_dir(scale, point)
    h = config_hash(point, scale, shards)
    recorded = _read_json(d / "point.json").get("config_hash") or _read_json(d / "done.json").get("config_hash")
    if recorded and recorded != h:
        raise ConfigError(f"point {point.study}/{point.name}", d, f"was made with config hash {recorded}, and its "
                          f"config now resolves to {h} (the study or the code changed): delete {d} to make it again, "
                          "or check out the commit named in its point.json")
    if (d / "done.json").is_file():
        return Plan(point, d, h, "done")
    if (d / "checkpoints").is_dir() and any((d / "checkpoints").glob("step_*/COMMIT")):
        return Plan(point, d, h, "resume")
    return Plan(point, d, h, "restart" if d.exists() else "new")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


class Runner:
    """Runs plans: training points `jobs` at a time (each with cores / jobs OpenMP threads), then the speed points
    one at a time; forwards SIGTERM/SIGINT to the running subprocesses (the trainer saves and exits 75) and stops."""

    def __init__(self, scale: Scale, shards: Path, jobs: int, progress: bool = True):
        self.scale, self.shards, self.jobs, self.progress = scale, shards, max(1, jobs), progress
        self.threads = max(1, (os.cpu_count() or 1) // self.jobs)
        self.children: set[subprocess.Popen] = set()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.commit = git_commit()

    # ---- signals -------------------------------------------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        self.stop.set()
        with self.lock:
            for child in self.children:
                if child.poll() is None:
                    child.send_signal(signal.SIGTERM)

    def run(self, plans: list[Plan]) -> None:
        todo = [p for p in plans if p.state != "done"]
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            from tqdm import tqdm

            with tqdm(total=len(plans), initial=len(plans) - len(todo), desc="repro points", unit="point",
                      disable=not self.progress, file=sys.stderr) as bar:
                train = [p for p in todo if p.point.kind == "train"]
                speed = [p for p in todo if p.point.kind != "train"]
                self._pool(train, self.jobs, bar)
                self._pool(speed, 1, bar)
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
        if self.stop.is_set():
            raise Stopped("stopped on request: run the same command again to continue")

    def _pool(self, plans: list[Plan], jobs: int, bar) -> None:
        errors: list[BaseException] = []

        def one(plan: Plan) -> None:
            if self.stop.is_set() or errors:
                return
            try:
                self.make(plan)
            except (PointFailed, Stopped) as err:
                errors.append(err)
                self.stop.set() if isinstance(err, Stopped) else None
                return
            bar.update(1)  # finished points only
            bar.set_postfix_str(f"{plan.point.study}/{plan.point.name}")

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(one, plans))
        failures = [e for e in errors if isinstance(e, PointFailed)]
        if failures:
            raise failures[0]

    # ---- one point -----------------------------------------------------------------------------------------------
    def make(self, plan: Plan) -> None:
        p, d = plan.point, plan.dir
        d.mkdir(parents=True, exist_ok=True)
        record = {"point": {**asdict(p), "labels": p.labels}, "config_hash": plan.hash, **self.commit,
                  "overrides": overrides(p, self.scale, self.shards), "started": _now()}
        (d / "point.json").write_text(json.dumps(record, indent=2, default=str))
        outcome, message, code = "completed", "", 0
        if p.kind == "train":
            outcome, message, code = self._train(plan)
            if outcome == "completed" and p.eval_depths:
                self._eval(plan)
        elif p.kind == "bench":
            self._bench(plan)
        elif p.kind == "ragged":
            self._ragged(plan)
        else:
            raise PointFailed(f"point {p.study}/{p.name}: unknown kind {p.kind!r} (train, bench or ragged)")
        done = {"config_hash": plan.hash, "exit_code": code, "outcome": outcome, "message": message,
                "finished": _now(), **self.commit}
        (d / "done.json").write_text(json.dumps(done, indent=2))

    def _train(self, plan: Plan) -> tuple[str, str, int]:
        p = plan.point
        head = ["train"] if p.nproc == 1 else ["launch", "--nproc-per-node", str(p.nproc)]
        cmd = [sys.executable, "-m", "megaloop", *head, str(REPO / p.config)]
        code, tail, _ = self._call(plan, cmd + _sets(overrides(p, self.scale, self.shards)))
        if code == 0:
            return "completed", "", 0
        if code == STOP_EXIT_CODE or self.stop.is_set():
            raise Stopped(f"{p.study}/{p.name} stopped and saved")
        if code == 1 and "not finite" in tail:  # megaloop.train.loop.TrainingDiverged: a result of the study
            return "diverged", tail, code
        raise PointFailed(f"point {p.study}/{p.name} failed (exit {code}): {tail}; see {plan.dir / 'repro.log'}")

    def _eval(self, plan: Plan) -> None:
        p = plan.point
        cmd = [sys.executable, "-m", "megaloop", "eval", str(plan.dir), "--tasks", p.eval_tasks, "--depths",
               ",".join(map(str, p.eval_depths)), "--val-rows", str(p.eval_rows), "--json"]
        self._capture(plan, cmd, plan.dir / "eval.json")

    def _bench(self, plan: Plan) -> None:
        p = plan.point
        out = plan.dir  # the bench's run (metrics.jsonl, summary.json) is the point's: an interrupted one starts over
        for name in ("metrics.jsonl", "summary.json", "config.json", "COMPLETED", "STOPPED", "bench.png"):
            (out / name).unlink(missing_ok=True)
        for name in ("checkpoints", "tb"):
            shutil.rmtree(out / name, ignore_errors=True)
        cmd = [sys.executable, "-m", "megaloop", "bench", str(REPO / p.config), "--steps", str(p.bench_steps),
               "--warmup", "2", "--nproc-per-node", str(p.nproc), "--out-dir", str(out), "--json",
               *_sets(overrides(p, self.scale, self.shards))]
        self._capture(plan, cmd, plan.dir / "bench.json", last_line=True)

    def _ragged(self, plan: Plan) -> None:
        p = plan.point
        cmd = [sys.executable, "-m", "megaloop.repro.ragged", str(REPO / p.config), "--steps", str(p.bench_steps),
               "--out", str(plan.dir / "ragged.json"), *_sets(overrides(p, self.scale, self.shards))]
        code, tail, _ = self._call(plan, cmd)
        self._check(plan, code, tail)

    def _capture(self, plan: Plan, cmd: list[str], path: Path, last_line: bool = False) -> None:
        code, tail, text = self._call(plan, cmd, capture=True)
        self._check(plan, code, tail)
        if last_line:
            text = [line for line in text.splitlines() if line.startswith("{")][-1]
        json.loads(text)  # what the studies read must be JSON
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)

    def _check(self, plan: Plan, code: int, tail: str) -> None:
        if code == 0:
            return
        if self.stop.is_set():
            raise Stopped(f"{plan.point.study}/{plan.point.name} stopped")
        raise PointFailed(f"point {plan.point.study}/{plan.point.name} failed (exit {code}): {tail}; see "
                          f"{plan.dir / 'repro.log'}")

    def _call(self, plan: Plan, cmd: list[str], capture: bool = False) -> tuple[int, str, str]:
        """Run one subprocess of the point (stderr, and stdout unless captured, appended to repro.log); returns the
        exit code, the log's last line and the captured stdout."""
        threads = str(max(1, self.threads // plan.point.nproc))  # each of the point's processes
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        log_path = plan.dir / "repro.log"
        with open(log_path, "a") as log:
            log.write(f"\n$ {' '.join(cmd)}\n")
            log.flush()
            with self.lock:
                if self.stop.is_set():
                    raise Stopped("stopped before the point started")
                child = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE if capture else log,
                                         stderr=log, start_new_session=True)  # signals reach it through us only
                self.children.add(child)
            out, _ = child.communicate()
            with self.lock:
                self.children.discard(child)
        lines = [line for line in log_path.read_text().splitlines() if line.strip()]
        return child.returncode, (lines[-1] if lines else ""), (out.decode() if capture else "")


def _sets(items: list[str]) -> list[str]:
    return [a for s in items for a in ("--set", s)]


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
