"""The load client (amqbroker.tools.perf, also scripts/perf.py and `amqbroker perf`): its
pure parts, and short end-to-end runs against a real broker through the scripts/perf.py
wrapper and the `amqbroker perf` verb.

Nothing here measures or asserts a time: the benchmark's figures are never tested.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from proton import Message

from amqbroker.tools import perf

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "perf.py"


# ------------------------------------------------------------------------ arguments


def test_defaults_make_one_custom_run() -> None:
    args = perf.parse_args([])
    assert [s.name for s in args.scenarios] == ["custom"]
    s = args.scenarios[0]
    assert (s.count, s.size, s.producers, s.consumers, s.groups) == (200_000, 100, 1, 1, 0)
    assert (args.window, args.credit, args.port) == (1000, 1000, 5672)


def test_scenarios_and_explicit_overrides() -> None:
    args = perf.parse_args(["--scenario", "a,G1K,l", "--count", "5000"])
    a, g, lat = args.scenarios
    assert (a.name, a.count, a.consumers, a.groups) == ("A", 5000, 1, 0)
    assert (g.name, g.count, g.consumers, g.groups) == ("G1K", 5000, 4, 1000)
    assert (lat.rate, lat.count) == (1000.0, 5000)
    e = perf.parse_args(["--scenario", "E"]).scenarios[0]
    assert e.durable and not e.presettled and e.count == 200_000
    custom = perf.parse_args(["--groups", "10", "--consumers", "2", "--presettled"]).scenarios[0]
    assert (custom.groups, custom.consumers, custom.presettled) == (10, 2, True)


def test_scenarios_run_interleaved_unless_asked_by_scenario() -> None:
    args = perf.parse_args(["--scenario", "A,C,G1K", "--runs", "2"])
    plan = [(sc.name, run) for sc, run in perf.run_plan(args.scenarios, args.runs, args.order)]
    assert plan == [("A", 1), ("C", 1), ("G1K", 1), ("A", 2), ("C", 2), ("G1K", 2)]
    args = perf.parse_args(["--scenario", "A,C", "--runs", "2", "--order", "by-scenario"])
    plan = [(sc.name, run) for sc, run in perf.run_plan(args.scenarios, args.runs, args.order)]
    assert plan == [("A", 1), ("A", 2), ("C", 1), ("C", 2)]


@pytest.mark.parametrize(
    "argv",
    [
        ["--order", "random"],
        ["--scenario", "Z"],
        ["--size", "16"],
        ["--groups", "1", "--producers", "2"],
        ["--ceiling", "--scenario", "HOL"],
        ["--ceiling", "--start-broker"],
        ["--window", "0"],
        ["--txn-batch", "-1"],
        ["--ceiling", "--txn-batch", "10"],
        ["--selector", " "],
    ],
)
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        perf.parse_args(argv)


def test_jms_feature_options() -> None:
    plain = perf.parse_args(["--scenario", "A"])
    assert (plain.selector, plain.app_props, plain.txn_batch) == (None, False, 0)
    assert perf.variant(plain) == ""
    sel = perf.parse_args(["--scenario", "C", "--selector"])
    assert sel.selector == perf.DEFAULT_SELECTOR == "kind = 'load' AND n >= 0"
    assert perf.variant(sel) == "+sel"
    own = perf.parse_args(["--selector", "n > 5", "--txn-batch", "100"])
    assert (own.selector, own.txn_batch) == ("n > 5", 100)
    assert perf.variant(own) == "+sel+txn100"
    assert perf.variant(perf.parse_args(["--app-props"])) == "+props"


def test_groups_are_split_in_blocks_between_producers() -> None:
    segs = perf.producer_segments(10, 5, 2)
    assert [s[0]["n"] for s in segs] == [5, 5]
    blocks = [(s[0]["gbase"], s[0]["groups"]) for s in segs]
    assert blocks == [(0, 3), (3, 2)]  # every group id belongs to exactly one producer
    assert perf.producer_segments(7, 0, 3) == [[{"n": 3}], [{"n": 2}], [{"n": 2}]]


def test_unique_address_keeps_queue_options_after_the_name() -> None:
    args = perf.parse_args(["--address-prefix", "/queue/"])
    addr = perf.unique_address(args, "orders?group-buckets=16", "a1")
    assert addr.startswith("/queue/orders-a1-")
    assert addr.endswith("?group-buckets=16")
    assert addr.count("?") == 1


def test_strict_setting_is_added_to_existing_address_settings() -> None:
    table = json.loads(perf.strict_address_settings('{"orders.#": {"max_delivery_attempts": 5}}'))
    assert table["hol-strict.#"] == {"group_skip_ahead": False}
    assert table["orders.#"] == {"max_delivery_attempts": 5}


# ---------------------------------------------------------------------------- maths


def test_percentiles_nearest_rank() -> None:
    values = list(range(1, 101))
    assert perf.percentile(values, 50) == 50
    assert perf.percentile(values, 90) == 90
    assert perf.percentile(values, 99) == 99
    assert perf.percentile(values, 100) == 100
    assert perf.percentile([7], 99) == 7
    assert perf.percentile([], 50) is None


def test_latency_summary_in_microseconds() -> None:
    s = perf.latency_summary([3000, 1000, 2000, 4000])  # ns, unsorted
    assert s == {"lat_p50_us": 2.0, "lat_p90_us": 4.0, "lat_p99_us": 4.0, "lat_max_us": 4.0}
    assert perf.latency_summary([])["lat_p99_us"] is None


def test_split_evenly() -> None:
    assert perf.split_evenly(10, 3) == [4, 3, 3]
    assert sum(perf.split_evenly(1_000_001, 4)) == 1_000_001


def _row(broker: str, scenario: str, rate: float, **kw: object) -> dict[str, object]:
    row: dict[str, object] = {"broker": broker, "scenario": scenario, "msgs_per_s": rate}
    row.update({"errors": 0, "lat_p99_us": 500.0, "broker_cpu_us_per_msg": 10.0})
    row.update(kw)
    return row


def test_summary_takes_medians_and_sums_errors() -> None:
    rows = [_row("b", "A", r) for r in (10.0, 30.0, 20.0)]
    rows[1]["errors"] = 2
    (s,) = perf.summarize(rows)
    assert (s["runs"], s["msgs_per_s"], s["msgs_per_s_min"], s["msgs_per_s_max"]) == (
        3,
        20.0,
        10.0,
        30.0,
    )
    assert s["errors"] == 2
    assert "| b | A | 3 |" in perf.summary_table([s])


def test_report_gives_ratios(tmp_path: Path) -> None:
    ours, peer = tmp_path / "ours.jsonl", tmp_path / "peer.jsonl"
    ours.write_text(json.dumps(_row("x", "A", 300.0)) + "\n")
    peer.write_text(
        json.dumps(_row("y", "A", 100.0)) + "\n" + json.dumps(_row("y", "L", 1000.0)) + "\n"
    )
    table = perf.render_report([f"ours={ours}", f"peer={peer}"])
    line = next(ln for ln in table.splitlines() if ln.startswith("| A |"))
    assert "| 3.00 |" in line
    assert any(ln.startswith("| L | - |") for ln in table.splitlines())


# ------------------------------------------------------------------------- encoding


@pytest.mark.parametrize(("size", "durable", "group"), [(100, False, None), (300, True, 12345)])
def test_hand_encoded_message_decodes(size: int, durable: bool, group: int | None) -> None:
    head = perf.PAYLOAD.pack(perf.MAGIC, 123, 1, 2, group or perf.NO_GROUP, 7)
    raw = perf.encode_message(head, size, durable=durable, group=group)
    m = Message()
    m.decode(raw)
    assert m.durable is durable
    assert m.group_id == (None if group is None else f"g{group}")
    body = bytes(m.body)
    assert len(body) == size
    assert raw.endswith(body)  # consumers read the payload from the message's tail
    assert perf.PAYLOAD.unpack_from(body)[:3] == (perf.MAGIC, 123, 1)


@pytest.mark.parametrize(("durable", "group"), [(False, None), (True, 42)])
def test_application_properties_for_the_selector(durable: bool, group: int | None) -> None:
    head = perf.PAYLOAD.pack(perf.MAGIC, 1, 0, 9, group or perf.NO_GROUP, 0)
    raw = bytearray(perf.encode_message(head, 100, durable=durable, group=group, n=0))
    if group is None:
        # producers rewrite n in place in their template
        off = (len(perf.DURABLE_HEADER) if durable else 0) + perf.APP_PROPS_N_OFFSET
        perf.N_FIELD.pack_into(raw, off, 123456789012)
    m = Message()
    m.decode(bytes(raw))
    assert m.properties == {"kind": "load", "n": 0 if group is not None else 123456789012}
    assert m.group_id == (None if group is None else f"g{group}")
    assert len(bytes(m.body)) == 100


def test_coordinator_messages_decode() -> None:
    m = Message()
    m.decode(perf.DECLARE_MESSAGE)
    assert (int(m.body.descriptor), m.body.value) == (0x31, [])
    m.decode(perf.discharge_message(b"\x00\x01txn"))
    assert int(m.body.descriptor) == 0x32
    assert [bytes(m.body.value[0]), m.body.value[1]] == [b"\x00\x01txn", False]


# ---------------------------------------------------------------------------- /proc


def test_proc_parsers_on_this_process() -> None:
    pid = os.getpid()
    with open(f"/proc/{pid}/stat") as f:
        assert perf.parse_stat_cpu_ticks(f.read()) >= 0
    assert perf.proc_cpu_seconds(pid) > 0
    rss = perf.proc_rss_kb(pid)
    assert rss is not None and rss > 1000
    assert perf.parse_status_kb("Name:\tx\nVmRSS:\t  4242 kB\n") == 4242
    assert perf.parse_status_kb("Name:\tx\n") is None
    assert "python" in perf.proc_cmdline(pid)
    assert perf.machine_busy_seconds() > 0
    ticks = perf.machine_cpu_ticks()
    assert len(ticks) == 8 and all(t >= 0 for t in ticks)
    with open("/proc/stat") as f:
        steal = int(f.readline().split()[8]) / os.sysconf("SC_CLK_TCK")
    assert perf.machine_steal_seconds() >= steal >= 0


def test_stat_parser_copes_with_spaces_and_parens_in_the_name() -> None:
    fields = ["S"] + ["0"] * 10 + ["150", "50"] + ["0"] * 30
    assert perf.parse_stat_cpu_ticks("42 (a) b (c)) " + " ".join(fields)) == 200


def test_listening_socket_is_found_by_port() -> None:
    text = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
        "timeout inode\n"
        "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000 0 0 "
        "777 1 0000000000000000 100 0 0 10 0\n"
        "   1: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000 0 0 "
        "888 1 0000000000000000 20 4 30 10 -1\n"
    )
    assert perf.parse_listen_inodes(text, 8080) == {"777"}
    assert perf.parse_listen_inodes(text, 8081) == set()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        assert perf.find_pid_by_port(s.getsockname()[1]) == os.getpid()


# ------------------------------------------------------------------------ end to end


def _perf_json(*argv: str) -> dict[str, object]:
    cmd = [sys.executable, str(SCRIPT), "--start-broker", "--runs", "1", "--warmup", "0"]
    p = subprocess.run(
        [*cmd, "--json", "--timeout", "60", *argv],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert p.returncode == 0 and len(lines) == 1, p.stdout + p.stderr
    row: dict[str, object] = json.loads(lines[0])
    return row


@pytest.mark.slow
def test_end_to_end_against_a_started_broker() -> None:
    a = _perf_json("--scenario", "A", "--count", "2000")
    assert (a["scenario"], a["received"], a["errors"], a["ok"]) == ("A", 2000, 0, True)
    assert a["broker_pid"] and a["msgs_per_s"] and a["lat_p99_us"] is not None

    g = _perf_json("--count", "2000", "--groups", "10", "--consumers", "2")
    assert (g["received"], g["errors"], g["group_check"]) == (2000, 0, "ok")
    assert (g["groups_seen"], g["group_split"], g["order_violations"]) == (10, 0, 0)


@pytest.mark.slow
def test_sigterm_stops_the_broker_the_run_started() -> None:
    """A perf run ended with SIGTERM (a script's kill, a CI timeout) stops the broker it
    started instead of leaving it running."""
    cmd = [sys.executable, str(SCRIPT), "--start-broker", "--warmup", "0", "--timeout", "60"]
    broker = 0
    try:
        with subprocess.Popen(
            [*cmd, "--scenario", "A", "--count", "100000000", "--no-progress"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        ) as p:
            try:
                assert p.stdout is not None
                head = p.stdout.readline()  # "# amqbroker at 127.0.0.1:P broker pid N (...)"
                broker = int(head.split(" broker pid ")[1].split()[0])
                assert os.path.exists(f"/proc/{broker}"), head
                p.send_signal(signal.SIGTERM)
                assert p.wait(timeout=60) == 128 + signal.SIGTERM
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        # the run stopped and reaped its broker before it exited
        assert not os.path.exists(f"/proc/{broker}"), "the started broker outlived the run"
    finally:
        if broker and os.path.exists(f"/proc/{broker}"):
            os.kill(broker, signal.SIGKILL)  # this test stops what it started


@pytest.mark.slow
def test_end_to_end_selector_and_transactions() -> None:
    r = _perf_json("--count", "2000", "--consumers", "2", "--selector", "--txn-batch", "300")
    assert (r["scenario"], r["received"], r["acked"], r["errors"]) == (
        "custom+sel+txn300",
        2000,
        2000,
        0,
    )
    assert r["producer_msgs_per_s"]
    # a selector that matches half of the messages: the other half never arrives
    cmd = [sys.executable, str(SCRIPT), "--start-broker", "--runs", "1", "--warmup", "0"]
    p = subprocess.run(
        [*cmd, "--json", "--timeout", "3", "--count", "400", "--selector", "n < 200"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    row = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("{")))
    assert (p.returncode, row["received"], row["missing"]) == (1, 200, 200)


# ------------------------------------------------------------------ amqbroker perf


def test_url_gives_host_port_and_credentials() -> None:
    assert perf.url_defaults("amqp://bob:s%40cret@example.org:5673") == {
        "host": "example.org",
        "port": 5673,
        "user": "bob",
        "password": "s@cret",
    }
    assert perf.url_defaults("127.0.0.1") == {"host": "127.0.0.1", "port": 5672}
    with pytest.raises(ValueError, match="plain AMQP"):
        perf.url_defaults("amqps://h:5671")
    # explicit options win over the URL's defaults
    args = perf.parse_args(["--port", "7000"], defaults=perf.url_defaults("amqp://h:6000"))
    assert (args.host, args.port) == ("h", 7000)


def test_progress_line_is_redrawn_and_erased() -> None:
    out = io.StringIO()
    p = perf.Progress(True, stream=out, period=0.0)
    p.update("A run 1", 0, 200)
    p.update("A run 1", 100, 200)
    p.clear()
    text = out.getvalue()
    assert "A run 1:  50% 100/200 messages" in text
    assert text.endswith("\r") and text.count("\r") == 4  # two lines drawn, one erased
    silent = io.StringIO()
    perf.Progress(False, stream=silent).update("x", 1, 2)
    assert silent.getvalue() == ""


def test_amqbroker_perf_verb_runs_and_prints_the_summary_table() -> None:
    """`amqbroker perf` is the same client: one short run against a broker it starts,
    live progress forced on (stderr is a pipe here), the summary table after one run."""
    exe = Path(sys.executable).with_name("amqbroker")
    p = subprocess.run(
        [
            *(str(exe), "perf", "--start-broker", "--runs", "1", "--warmup", "0"),
            *("--count", "1000", "--groups", "10", "--consumers", "2", "--timeout", "60"),
            "--progress",
        ],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("AMQBROKER_")},
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "| broker | scenario | runs | msgs/s (median)" in p.stdout, p.stdout
    assert "| amqbroker | custom | 1 |" in p.stdout and "| ok |" in p.stdout, p.stdout
    assert "messages," in p.stderr and "msgs/s" in p.stderr, p.stderr  # the live line


def test_amqbroker_perf_help_and_unreachable_broker() -> None:
    exe = Path(sys.executable).with_name("amqbroker")
    h = subprocess.run([str(exe), "perf", "--help"], capture_output=True, text=True, check=False)
    assert h.returncode == 0 and "usage: amqbroker perf" in h.stdout and "--scenario" in h.stdout
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    p = subprocess.run(
        [str(exe), "perf", "--url", f"amqp://127.0.0.1:{free}", "--warmup", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"amqbroker perf: cannot connect to 127.0.0.1:{free}" in p.stderr
