"""Client-side tools of the `amqbroker` command: they talk to a broker over AMQP like
any client (or prepare files for one) and never run inside it.

- `management_client`: the CLI's blocking client of the broker's `$management` node;
- `messaging`: the `producer`, `consumer` and `browser` commands (Proton's blocking
  API: one message at a time is fast enough for an operator);
- `instance`: `amqbroker create DIR` (an instance folder) and `amqbroker run DIR`;
- `settings_report`: `amqbroker config show` (each effective setting and its source);
- `perf`: `amqbroker perf`, the multi-process load client (Proton's cffi layer).

Layering (docs/ARCHITECTURE.md): `amqbroker.tools` sits between `cli` and `app`; it
may import proton (it is a client), `protocol` (client auth, errors, the cffi
bindings) and `settings`, but never the broker's server side (app, net, store,
telemetry, core), which import-linter checks.
"""
