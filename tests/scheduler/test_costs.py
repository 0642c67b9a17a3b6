"""engine/costs.py: this machine's forward costs (measured in a child process, cached) and the choice they
drive under a budget, whether the draft `--draft auto` picked pays for the target layers it pushes to disk."""

import json
import os
import signal
import time

import pytest

from engine.costs import Costs, costs, draft_pays
from formats.convert import convert
from formats.source_hf import HFSource
from formats.store import WeightStore
from formats.weights import random_tensors
from tests.conftest import TINY
from tests.models.tiny_files import write_hf_dir

MiB = 1 << 20


def _costs(disk_gbps=1.0, layer_ms=1.0, draft_layer_ms=0.5) -> Costs:
    """Hand-made prices: a layer's linear work grows with the rows as a kernel's does (about flat up to 4)."""
    rows = (1, 2, 3, 5, 9, 17, 33)
    return Costs(
        disk_gbps,
        {r: layer_ms * 1e-3 * max(1.0, r / 4) for r in rows},
        {r: 1e-3 * max(1.0, r / 4) for r in rows},
        draft_layer_ms * 1e-3,
        1e-3,
    )


def _store(tmp_path, name="qwen") -> WeightStore:
    args = TINY[name]
    return WeightStore(
        convert(
            HFSource(write_hf_dir(tmp_path / f"hf-{name}", args, random_tensors(args, seed=3))),
            tmp_path / f"s-{name}",
            "int4",
        )
    )


def test_a_forward_costs_its_compute_or_its_reads_whichever_is_longer():
    c = _costs(disk_gbps=1.0, layer_ms=2.0)
    assert c.forward_s(10, 1, 0) == 10 * 2e-3 + 1e-3  # resident: the linear work alone
    assert c.forward_s(10, 1, 500 * 10**6) == 0.5  # streamed: the disk's half second hides the compute
    assert c.forward_s(10, 9, 0) < c.forward_s(10, 13, 0) < c.forward_s(10, 17, 0)  # between the widths measured
    # past the widest (33 rows): at its slope, as a batch's trees of 4 x 17 rows cost (the nearest width, 33, was
    # taken for them before: half their price)
    assert c.forward_s(10, 68, 0) == pytest.approx(10 * 2e-3 * 68 / 4 + 1e-3 * 68 / 4)


def test_the_draft_pays_unless_it_pushes_too_much_of_the_target_to_disk(tmp_path):
    target, draft = _store(tmp_path), _store(tmp_path, "qwen")
    c = _costs(disk_gbps=1.0)
    # nothing more to read with the draft: a tree of 2.5 tokens per verification beats a plain step
    assert draft_pays(c, target, draft, 100 * MiB, 100 * MiB, width=8)
    # the draft triples the bytes every forward reads: 2.5 tokens per verification cannot pay that
    assert not draft_pays(c, target, draft, 450 * MiB, 150 * MiB, width=8)
    # the same reads with a draft that accepts more (measured elsewhere) pay again
    assert draft_pays(c, target, draft, 450 * MiB, 150 * MiB, width=8, tokens_per_verification=4.0)
    # ... unless the trie alone writes nearly as many a forward (a workload that copies its prompt: measured here)
    assert not draft_pays(c, target, draft, 450 * MiB, 150 * MiB, 8, tokens_per_verification=4.0, tokens_without=2.0)


def test_costs_are_measured_once_in_a_child_and_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CADENCE_HOME", str(tmp_path / "home"))
    target = _store(tmp_path)
    got = costs(target, target)
    assert got.disk_gbps > 0 and got.draft_layer_s > 0 and got.draft_head_s > 0
    assert set(map(int, got.layer_s)) == {1, 2, 3, 5, 9, 17, 33} and all(v > 0 for v in got.head_s.values())
    (cached,) = (tmp_path / "home" / "calibration").glob("costs-*.json")
    cached.write_text(json.dumps({**json.loads(cached.read_text()), "disk_gbps": 123.0}))
    assert costs(target, target).disk_gbps == 123.0  # read back, not measured again


def test_a_wider_tree_is_free_only_where_the_disk_hides_its_verification():
    c = _costs(disk_gbps=1.0, layer_ms=1.0)
    verify, read = c.hidden_by_reads(28, 17, 600 * 10**6)
    assert verify < read  # 28 layers at 17 rows: ~0.13 s against 0.6 s of reads
    verify, read = c.hidden_by_reads(28, 17, 50 * 10**6)
    assert verify > read  # most of the target resident: the wider pass is paid in compute


def test_the_width_left_out_is_auto_and_a_given_one_is_kept():
    from common.settings import TreeConfig
    from engine.config import RunConfig

    auto, given = RunConfig.from_options(), RunConfig.from_options(width=TreeConfig.width)
    assert auto.tree.width == given.tree.width == TreeConfig.width
    assert auto.tree.width_auto and not given.tree.width_auto
    assert RunConfig.from_options(**auto.options()) == auto and RunConfig.from_options(**given.options()) == given


def test_a_calibration_file_that_cannot_be_read_is_measured_again(tmp_path, monkeypatch):
    import sys

    import pytest

    from common.calibration import cached, child_json
    from common.errors import CadenceError

    monkeypatch.setenv("CADENCE_HOME", str(tmp_path))
    taken = []

    def measure():
        taken.append(1)
        return {"x": len(taken)}

    assert cached("probe", "k", measure, lambda d: d["x"]) == 1
    assert cached("probe", "k", measure, lambda d: d["x"]) == 1  # kept
    (tmp_path / "calibration" / "probe-k.json").write_text('{"y": 1}')  # damaged: no "x"
    assert cached("probe", "k", measure, lambda d: d["x"]) == 2
    assert child_json([sys.executable, "-c", "print('{\"a\": 1}')"], "probing") == {"a": 1}
    with pytest.raises(CadenceError, match=r"^probing failed \(SystemExit: bad\); retry$"):
        child_json([sys.executable, "-c", "raise SystemExit('SystemExit: bad')"], "probing", "; retry")


def test_costs_measured_on_a_busy_machine_serve_the_run_and_are_not_kept(tmp_path, monkeypatch):
    """Processes spinning on half this machine's cores while the costs are measured (a first run beside a
    download or a build): the figures price this run, say so, and are not cached; measured again on the quiet
    machine, they are, and say when and how they were taken."""
    import subprocess
    import sys

    monkeypatch.setenv("CADENCE_HOME", str(tmp_path / "home"))
    target, said = _store(tmp_path), []
    spinners = max(1, (os.cpu_count() or 2) // 2)  # half the cores busy: well past the quiet share, and the
    # measurement, slowed by them, still takes seconds, not a minute
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(spinners)]
    try:
        busy = costs(target, target, said.append)
    finally:
        for p in spin:
            p.kill()
            p.wait()
    assert not busy.kept and busy.load["cpu"] > 0.25, busy.load
    assert "busy with other work: used for this run, not kept" in said[-1], said
    assert "used for this run only, not kept" in busy.describe()
    assert not list((tmp_path / "home" / "calibration").glob("costs-*.json"))
    quiet = costs(target, target, said.append)
    assert quiet.kept and quiet.load["cpu"] < 0.25 and quiet.measured_at
    assert len(list((tmp_path / "home" / "calibration").glob("costs-*.json"))) == 1
    assert quiet.describe().startswith(f"costs: disk {quiet.disk_gbps:.2f} GB/s") and "measured 20" in quiet.describe()


def test_costs_measured_beside_a_disk_bound_neighbour_are_not_kept(tmp_path, monkeypatch):
    """A process reading a file with direct reads, over and over, while the costs are measured (a copy or a
    download beside a first run): the disk was busy with other work, so the figures price this run only."""
    import subprocess

    monkeypatch.setenv("CADENCE_HOME", str(tmp_path / "home"))
    target, said = _store(tmp_path), []
    big = tmp_path / "big"
    with open(big, "wb") as f:
        for _ in range(64):
            f.write(bytes(4 << 20))
        os.fsync(f.fileno())
    loop = f"while :; do dd if={big} of=/dev/null bs=4M iflag=direct status=none || exit 1; done"
    reader = subprocess.Popen(["sh", "-c", loop], start_new_session=True)
    try:
        time.sleep(0.3)
        assert reader.poll() is None, "direct reads are refused on this file system"
        busy = costs(target, target, said.append)
    finally:
        os.killpg(reader.pid, signal.SIGKILL)
        reader.wait()
    assert not busy.kept and busy.load["disk"] > 0.2, busy.load
    assert "busy with other work: used for this run, not kept" in said[-1], said
    assert not list((tmp_path / "home" / "calibration").glob("costs-*.json"))


def test_a_runs_reads_raise_a_disk_rate_kept_too_low_and_nothing_else(tmp_path, monkeypatch):
    """A disk rate kept from a busy moment (here a tenth of what was measured) is raised by a run whose loader read
    a GiB or more faster than 1.25x it: said, kept with when and how much, and the next plan's figure. Fewer bytes,
    or a slower run (its reads shared the disk), change nothing."""
    from engine.costs import refresh_disk

    monkeypatch.setenv("CADENCE_HOME", str(tmp_path / "home"))
    for name, value in (("busy_reason", lambda load: None), ("MAX_SPREAD", 1e9), ("MAX_DISK_SPREAD", 1e9)):
        monkeypatch.setattr(f"engine.costs.{name}", value)  # kept whatever the machine is doing meanwhile
    target = _store(tmp_path)
    measured = costs(target, None)
    (kept,) = (tmp_path / "home" / "calibration").glob("costs-*.json")
    low = measured.disk_gbps / 10
    kept.write_text(json.dumps({**json.loads(kept.read_text()), "disk_gbps": low}))
    said = []
    assert refresh_disk(512 << 20, (512 << 20) / (2 * low * 1e9), said.append) == []  # too few bytes to speak
    assert refresh_disk(2 << 30, (2 << 30) / (1.1 * low * 1e9), said.append) == []  # not enough faster
    assert costs(target, None).disk_gbps == low and not said
    assert refresh_disk(2 << 30, (2 << 30) / (5 * low * 1e9), said.append) == [kept]
    again = costs(target, None)
    assert again.disk_gbps == pytest.approx(5 * low) and "2.0 GiB read" in again.refreshed
    assert "raised by a run's reads" in again.describe() and "faster than the" in said[0]
    assert refresh_disk(2 << 30, (2 << 30) / (2 * low * 1e9)) == []  # slower than the figure now kept


def test_launch_calibrate_measures_again_whatever_is_cached(tmp_path):
    """`launch calibrate` over a cached figure it would otherwise read back: measured anew, said, and kept."""
    import os
    import subprocess
    import sys

    from common import paths
    from tests.conftest import REPO

    home, hf = tmp_path / "home", write_hf_dir(tmp_path / "hf", TINY["qwen"], random_tensors(TINY["qwen"], seed=3))
    env = dict(os.environ, CADENCE_HOME=str(home), CADENCE_KERNELS_DIR=str(paths.kernels_dir()))
    cmd = [sys.executable, "-m", "launch.cli", "calibrate", "--target", str(hf), "--draft", "none", "--dtype", "int4"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert first.returncode == 0 and "costs: disk" in first.stdout, first.stderr[-2000:]
    (kept,) = (home / "calibration").glob("costs-*.json")
    kept.write_text(json.dumps({**json.loads(kept.read_text()), "disk_gbps": 123.0}))
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert again.returncode == 0 and "costs: disk 123.00" not in again.stdout, again.stdout
    assert json.loads(kept.read_text())["disk_gbps"] != 123.0


def test_a_runs_forwards_lower_row_figures_kept_too_high_and_nothing_else(tmp_path, monkeypatch):
    """Row figures kept from a busy moment (here a thousand times what was measured) are lowered by a real run whose
    whole target forwards (16 and more) took less than the kept figures price their linear work alone: said, kept
    with when, scaled to what the run measured, and the next plan's figures. A run no faster than the figures kept
    (the same model again) changes nothing; nor do the figures of another target, or a run without learning."""
    from common import paths
    from engine.config import RunConfig
    from engine.costs import refresh_compute
    from engine.prompts import Prompt
    from engine.runner import Runner

    monkeypatch.setenv("CADENCE_KERNELS_DIR", str(paths.kernels_dir()))
    monkeypatch.setenv("CADENCE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CADENCE_LEARN", "1")
    for name, value in (("busy_reason", lambda load: None), ("MAX_SPREAD", 1e9), ("MAX_DISK_SPREAD", 1e9)):
        monkeypatch.setattr(f"engine.costs.{name}", value)
    hf = write_hf_dir(tmp_path / "hf", TINY["qwen"], random_tensors(TINY["qwen"], seed=3))
    cfg = RunConfig.from_options(
        target=str(hf), draft="none", mode="target", runtime="inproc", dtype="int4", max_new_tokens=80, no_trace=True
    )
    prompt = Prompt("p", "raw", "one two three four")

    def run(said: list):
        with Runner(cfg, say=said.append) as runner:
            done = runner.run(prompt, reuse=False)
            assert len(done.token_ids) == 80, done.finish_reason
            return runner.plan.target, costs(runner.plan.target, None)  # measured or read before the run closes

    said = []
    target, _ = run(said)
    assert not any("busy machine" in s for s in said), said  # the figures just measured: the run is no faster
    (path,) = (tmp_path / "home" / "calibration").glob("costs-*.json")
    other = path.with_name("costs-another.json")  # another target's figures: not this run's to change
    high = {**json.loads(path.read_text())}
    high.update({k: {r: t * 1000 for r, t in high[k].items()} for k in ("layer_s", "head_s")})
    path.write_text(json.dumps(high))
    other.write_text(json.dumps({**high, "target": str(tmp_path / "elsewhere")}))
    monkeypatch.setenv("CADENCE_LEARN", "0")
    _, kept = run([])
    assert kept.layer_s == {int(r): t for r, t in high["layer_s"].items()}  # nothing learned
    monkeypatch.setenv("CADENCE_LEARN", "1")
    said = []
    run(said)
    assert any("measured on a busy machine" in s for s in said), said
    lowered = costs(target, None)
    assert lowered.layer_s[9] < high["layer_s"]["9"] / 2 and "lowered by a run's forwards" in lowered.describe()
    assert json.loads(other.read_text())["layer_s"] == high["layer_s"]
    from engine.costs import Forwards

    one = lowered.forward_s(target.args.n_layers, 1, 0)  # what a forward of one row now prices at: the run's
    assert refresh_compute(target, Forwards(plain=80, seconds=80 * one / 1.2)) == []  # not 1.25x faster
    assert refresh_compute(target, Forwards(plain=15, seconds=1e-9)) == []  # too few forwards to speak
    assert costs(target, None).layer_s == lowered.layer_s


def test_a_generations_forwards_count_their_rows_and_seconds():
    """A speculative generation's plain steps (one row) and verifications (their trees' rows and the root's), in
    the seconds its loop timed them; a target-only one's tokens after the prompt's, in its decode time."""
    from engine.costs import Forwards

    f = Forwards()
    f.add({"verifications": 10, "plain_steps": 4, "drafted": 80, "verify_s": 1.5}, 40, 9.0)
    assert (f.plain, f.verifications, f.rows, f.seconds, f.count) == (4, 10, 90, 1.5, 14)  # 9 rows a verification
    f.add({}, 33, 0.8)  # a target-only generation: 32 forwards after the prompt's
    assert (f.plain, f.verifications, f.seconds) == (36, 10, pytest.approx(2.3))
    f.add({}, 1, 0.1)  # the prompt's token alone: no forward after it
    assert f.count == 46
