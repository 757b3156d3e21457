"""`amqbroker perf`: the project's own benchmark, a fast AMQP 1.0 load client and the
scenarios of issues 3 and 4.

It needs python-qpid-proton and the stdlib only. ``scripts/perf.py`` is the same tool
(a thin wrapper kept for existing commands)::

    amqbroker perf --start-broker --scenario A,C,D,E,L
    amqbroker perf --url amqp://127.0.0.1:5672 --producers 1 --consumers 4 --groups 1000
    amqbroker perf --start-broker --scenario G1K,G100K,G1M,HOL,MEM --runs 1
    amqbroker perf --ceiling --scenario A,C      # the client's own ceiling

Modules: `options` (argparse, scenarios, how work is split), `encoding` (the
hand-encoded messages), `engine` (Proton's cffi layer, the socket `Wire`), `status`
(the shared status file), `workers` (producer and consumer processes), `nullbroker`
(--ceiling), `broker` (the broker under test: given, started, or the null broker),
`stats` (percentiles, /proc readers), `report` (lines, summary table, --report, live
progress), `runner` (the orchestrator and `main`).

The client
----------
Every producer and every consumer is its own OS process (``python -m
amqbroker.tools.perf --_worker SPEC``), so the client scales past one core. Each drives
one connection with one link through Proton's engine: the object API only sets the
connection and the link up; transfers, dispositions and flow go through
``cproton_ffi.lib`` directly (the object API is ~10x slower and would make the client
the bottleneck). Sockets are non-blocking; reads push up to 1 MiB into the transport
before the events are handled, and the transport's output is written in one ``send`` per
batch.

Messages are hand-encoded: [header durable=true] [properties with group-id] data
section. The first 32 body bytes carry a magic, the CLOCK_MONOTONIC send time, the
producer, the message index, the group and the group sequence, so the consumers
measure latency (same host, same clock) and check grouping: every group must reach one
consumer only, in order.

Producers keep at most ``--window`` unsettled deliveries (never more than the link
credit), settle each on the broker's outcome and count every non-accepted outcome as
an error. Consumers grant ``--credit``, topped up when half is used, and accept and
settle every delivery. Processes report progress through a small shared file (mmap)
and take "go"/"stop" on stdin.

What is printed per run: msgs/s (first send -> last receive), latency p50/p90/p99/max,
broker CPU % and CPU us per message (/proc/PID/stat), broker RSS (sampled every 100 ms),
the client's own CPU us per message (all its processes), and "other cores": machine
load from unrelated processes during the run (a shared machine is noisy; compare runs
with similar values). The broker process is --broker-pid, or the one started with
--start-broker, or the local process listening on the port (/proc/net/tcp +
/proc/*/fd). Benchmarks are never tests: nothing here asserts a time.

Scenarios (--scenario, comma separated)
---------------------------------------
A     1 producer -> 1 consumer, 100 B, at-least-once (200,000 messages)
C     1 producer -> 4 consumers
D     presettled sends
E     durable messages (header durable=true, durable terminus)
L     fixed 1,000 msgs/s (10,000 messages): latency
G1K   1 producer -> 4 consumers, 1,000 groups
G100K 1 producer -> 4 consumers, 100,000 groups
G1M   1 producer -> 4 consumers, 1,000,000 groups (1,000,000 messages): broker RSS
      growth per bound group (RSS with every group bound minus RSS before, / groups)
HOL   Artemis's head-of-line case: a slow consumer (credit 1, holds each message
      --hol-hold-ms) owns a group whose 100 messages sit at the head of the queue,
      1,000 ungrouped messages behind them, then 3 consumers with normal credit start:
      time until the 1,000 ungrouped are consumed. Runs twice: once on an ordinary
      queue, once on an address under "hol-strict." (amqbroker's strict setting
      group_skip_ahead=false, which --start-broker sets through
      AMQBROKER_ADDRESS_SETTINGS; set it yourself for a broker you started).
MEM   1,000,000 x 100 B sent to a queue without consumer: broker RSS growth per queued
      message beyond its payload; then drained by one consumer.

Options given explicitly override a scenario's values (e.g. ``--scenario A --count
20000``). Without --scenario one run is made from the options. Several scenarios run
interleaved (run 1 of each, then run 2 of each, ...), so that a comparison between them
within one invocation is not skewed by a shared machine drifting meanwhile;
``--order by-scenario`` runs all of one scenario's runs before the next.

JMS features (any scenario)
---------------------------
--selector [TEXT]  every consumer attaches with a JMS selector filter (key jms-selector,
      descriptor 0x0000468C00000004; default "kind = 'load' AND n >= 0") and producers
      add application properties kind='load' (string) and n=<message index> (long), so
      that the default selector matches every message. --app-props adds the properties
      without a selector (the baseline that isolates the filter).
--txn-batch N  producers send in local transactions of N messages, on the raw path too:
      a coordinator link (capability amqp:local-transactions) on the producer's session,
      Declare -> declared {txn-id}, N transfers carrying transactional-state {txn-id},
      Discharge [txn-id, false], and the next Declare only after its accepted.
      "producers ... msgs/s" is then the committed rate.
Runs with these options are labelled e.g. "C+sel", "A+txn100".

--ceiling runs the same worker processes against a minimal "null broker" (a
raw-cffi relay: accepts connections, forwards every transfer from producer links to
consumer links, settles; no queue logic) and so shows what the client itself can move
on this machine, and at what CPU cost per message. The group check is skipped there (the
relay does not group).

--report NAME=FILE ... combines the --json output of several brokers into a markdown
table with ratios (first NAME / each other); scripts/compare-peers uses it.
"""

from amqbroker.tools.perf.broker import RunError, Target, strict_address_settings
from amqbroker.tools.perf.encoding import (
    APP_PROPS_N_OFFSET,
    DECLARE_MESSAGE,
    DEFAULT_SELECTOR,
    DURABLE_HEADER,
    MAGIC,
    MIN_SIZE,
    N_FIELD,
    NO_GROUP,
    PAYLOAD,
    discharge_message,
    encode_message,
    message_head,
)
from amqbroker.tools.perf.options import (
    SCENARIOS,
    Scenario,
    build_parser,
    parse_args,
    producer_segments,
    run_plan,
    url_defaults,
    variant,
)
from amqbroker.tools.perf.report import (
    Progress,
    format_row,
    render_report,
    summarize,
    summary_table,
)
from amqbroker.tools.perf.runner import main, unique_address
from amqbroker.tools.perf.stats import (
    find_pid_by_port,
    latency_summary,
    machine_busy_seconds,
    machine_cpu_ticks,
    machine_steal_seconds,
    parse_listen_inodes,
    parse_stat_cpu_ticks,
    parse_status_kb,
    percentile,
    proc_cmdline,
    proc_cpu_seconds,
    proc_rss_kb,
    split_evenly,
)

__all__ = [
    "APP_PROPS_N_OFFSET",
    "DECLARE_MESSAGE",
    "DEFAULT_SELECTOR",
    "DURABLE_HEADER",
    "MAGIC",
    "MIN_SIZE",
    "NO_GROUP",
    "N_FIELD",
    "PAYLOAD",
    "SCENARIOS",
    "Progress",
    "RunError",
    "Scenario",
    "Target",
    "build_parser",
    "discharge_message",
    "encode_message",
    "find_pid_by_port",
    "format_row",
    "latency_summary",
    "machine_busy_seconds",
    "machine_cpu_ticks",
    "machine_steal_seconds",
    "main",
    "message_head",
    "parse_args",
    "parse_listen_inodes",
    "parse_stat_cpu_ticks",
    "parse_status_kb",
    "percentile",
    "proc_cmdline",
    "proc_cpu_seconds",
    "proc_rss_kb",
    "producer_segments",
    "render_report",
    "run_plan",
    "split_evenly",
    "strict_address_settings",
    "summarize",
    "summary_table",
    "unique_address",
    "url_defaults",
    "variant",
]
