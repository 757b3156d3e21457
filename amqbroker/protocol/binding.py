"""Proton's raw cffi layer (`cproton_ffi`): the one module that binds its symbols.

Two hot paths drive Proton's engine through `cproton_ffi.lib` instead of the object API
(about 10x faster, ARCHITECTURE.md decision 1): the broker's `protocol.fastpath` and
the perf load client (`tools.perf`: engine, workers, null broker). Both take their
functions from here, so the symbols are declared once and checked once.

The raw layer is not a public API, which is why the project pins
python-qpid-proton==0.40.*: importing this module fails loudly, naming every missing
symbol, when the installed wheel lacks one that is bound below (`REQUIRED`).

Speed: the names are plain module globals holding the cffi functions. Users import
them as their own module globals (`from amqbroker.protocol.binding import
collector_peek as _peek`) or bind them as locals, so a call costs one global or local
lookup, exactly as when each module bound `lib.pn_...` itself.
"""

from __future__ import annotations

from cproton_ffi import ffi, lib

__all__ = ["ffi", "lib"]  # re-exported; the names bound below are module attributes

REQUIRED = (
    "pn_collector_peek pn_collector_pop pn_event_type pn_event_delivery pn_event_link "
    "pn_event_session pn_delivery_link pn_delivery_readable pn_delivery_partial "
    "pn_delivery_aborted pn_delivery_pending pn_link_recv pn_link_advance pn_delivery "
    "pn_link_send pn_delivery_settle pn_delivery_update pn_delivery_remote_state "
    "pn_delivery_settled pn_delivery_remote pn_delivery_local pn_disposition_is_failed "
    "pn_disposition_is_undeliverable pn_disposition_condition pn_disposition_data "
    "pn_condition_set_name pn_condition_set_description pn_link_credit pn_link_get_drain "
    "pn_link_drained pn_link_flow pn_link_unsettled pn_link_session "
    "pn_transport_capacity pn_transport_push pn_transport_pending pn_transport_peek "
    "pn_transport_pop pn_transport_close_tail pn_transport_close_head pn_transport_tick "
    "pn_data_clear pn_data_put_list pn_data_put_binary pn_data_enter pn_data_exit"
).split()

_missing = [n for n in REQUIRED if not hasattr(lib, n)]
if _missing:  # pragma: no cover - depends on the installed wheel
    raise RuntimeError(
        "the installed python-qpid-proton lacks cffi symbols amqbroker needs "
        f"({', '.join(_missing)}); install python-qpid-proton==0.40.*"
    )

# event and delivery types / states
PN_DELIVERY: int = lib.PN_DELIVERY
PN_LINK_FLOW: int = lib.PN_LINK_FLOW
PN_TRANSPORT: int = lib.PN_TRANSPORT
PN_ACCEPTED: int = lib.PN_ACCEPTED
PN_REJECTED: int = lib.PN_REJECTED
PN_RELEASED: int = lib.PN_RELEASED
PN_MODIFIED: int = lib.PN_MODIFIED
PN_RECEIVED: int = lib.PN_RECEIVED

# collector and events
collector_peek = lib.pn_collector_peek
collector_pop = lib.pn_collector_pop
event_type = lib.pn_event_type
event_delivery = lib.pn_event_delivery
event_link = lib.pn_event_link
event_session = lib.pn_event_session

# deliveries
new_delivery = lib.pn_delivery
delivery_link = lib.pn_delivery_link
delivery_readable = lib.pn_delivery_readable
delivery_partial = lib.pn_delivery_partial
delivery_aborted = lib.pn_delivery_aborted
delivery_pending = lib.pn_delivery_pending
delivery_settle = lib.pn_delivery_settle
delivery_update = lib.pn_delivery_update
delivery_remote_state = lib.pn_delivery_remote_state
delivery_settled = lib.pn_delivery_settled  # remotely settled
delivery_remote = lib.pn_delivery_remote  # the remote disposition
delivery_local = lib.pn_delivery_local  # the local disposition
disposition_is_failed = lib.pn_disposition_is_failed
disposition_is_undeliverable = lib.pn_disposition_is_undeliverable
disposition_condition = lib.pn_disposition_condition
disposition_data = lib.pn_disposition_data
condition_set_name = lib.pn_condition_set_name
condition_set_description = lib.pn_condition_set_description

# links
link_recv = lib.pn_link_recv
link_send = lib.pn_link_send
link_advance = lib.pn_link_advance
link_flow = lib.pn_link_flow
link_credit = lib.pn_link_credit
link_get_drain = lib.pn_link_get_drain
link_drained = lib.pn_link_drained
link_unsettled = lib.pn_link_unsettled
link_session = lib.pn_link_session

# transport input / output
transport_capacity = lib.pn_transport_capacity
transport_push = lib.pn_transport_push
transport_pending = lib.pn_transport_pending
transport_peek = lib.pn_transport_peek
transport_pop = lib.pn_transport_pop
transport_close_tail = lib.pn_transport_close_tail
transport_close_head = lib.pn_transport_close_head
transport_tick = lib.pn_transport_tick

# pn_data (transactional delivery states)
data_clear = lib.pn_data_clear
data_put_list = lib.pn_data_put_list
data_put_binary = lib.pn_data_put_binary
data_enter = lib.pn_data_enter
data_exit = lib.pn_data_exit

# cffi helpers
from_buffer = ffi.from_buffer
unpack = ffi.unpack
NULL = ffi.NULL
