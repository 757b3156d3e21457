#!/usr/bin/env node
// An AMQP 1.0 command-line client built on rhea, used by the amqbroker interop tests
// (tests/integration/test_rhea_interop.py) as a second, independent AMQP implementation.
//
//   node rhea_client.js <scenario> --port P [--address A] [--count N] [options]
//
// Every event or result is printed as one JSON object per line on stdout. Exit status:
// 0 success; 1 a check of the scenario failed (the lines printed so far show what
// happened); 2 bad usage; 3 timeout, refused link or lost connection. The reason for a
// non-zero status is always written to stderr. Every wait is bounded by --timeout.
//
// Scenarios
//   send       send N messages, wait until the broker settled each; prints the outcome
//   receive    receive N messages with credit N (--credit), accept each, print each
//   roundtrip  send N then receive N on one connection; checks bodies and order
//   groups     2 receivers (one connection each) on one queue, then 1 sender of grouped
//              messages; checks each group went to exactly one receiver, in order
//   dynamic    dynamic receiver, send to the address the broker gave it, receive
//   anonymous  anonymous-relay sender (null target) with `to` set per message, then
//              receive from every destination
//   release    send 1 message, receive it, release it (delivery-count unchanged),
//              modify it with delivery-failed (count + 1), accept, then drain
//   selector   send the messages to a queue, receive with a JMS selector (source filter
//              jms-selector, descriptor 0x0000468C00000004) until drained, then take
//              the rest with a plain receiver; --expect-refused: only attach the
//              filtered receiver and report the broker's refusal (exit 1 if it attaches)
//   no-local   topic: connection A has a no-local subscriber (filter no-local,
//              descriptor 0x0000468C00000003) and a sender, connection B a plain
//              subscriber and a sender; both send --count messages
//   temp-queue JMS temporary queue: a sender with a dynamic target (temporary-queue,
//              delete-on-close), a receiver on the address it got, a second connection
//              sends to it; closing the creator link deletes it (a later send fails)
//   temp-topic JMS temporary topic: dynamic target with capability temporary-topic; two
//              subscribers (one connection each) each get every message
//   durable-sub  durable subscription: link name --sub, fixed --container-id, source
//              topic + durable 2 + expiry never + distribution-mode copy (as Qpid JMS
//              sends it); detach (not close) keeps it, messages
//              sent meanwhile arrive on re-attach from a new connection; close (or with
//              --unsubscribe-by-name: attach by link name with no source, then close)
//              removes it
//   shared-sub shared subscription: two receivers (links <sub>|volatile1/2, capability
//              shared; --global: + global, one connection each, links
//              <sub>|global-volatile1) share the messages; a plain subscriber gets all
//   browse     queue browser (distribution-mode copy): sees every message in order
//              twice without consuming; then a normal receiver consumes them
//   drain      drain on an empty queue completes promptly; then on 2 messages
//   prefetch0  two receivers alternately grant 1 credit at a time (JMS prefetch 0)
//   txn        local transactions through a Coordinator target (rhea has no
//              transaction API: the coordinator target, Declare/Discharge bodies and
//              the transactional-state of a transfer are encoded by hand)
//   echo       attach a receiver to --address and check the broker's source address
//              is exactly the one sent
//
// Common options
//   --host H (127.0.0.1)  --port P (required)  --timeout SECONDS (10, per wait)
//   --username U --password P   SASL PLAIN (default: no SASL layer at all)
//   --sasl-anonymous            SASL ANONYMOUS
//   --container-id ID
//   --websocket                 AMQP over WebSocket (ws://host:port/, subprotocol amqp,
//                               the npm ws package): rhea.websocket_connect(require('ws'))
//   --ca FILE                   with --websocket: wss:// instead, trusting the PEM CA FILE
// Messages (send, roundtrip, groups, dynamic, anonymous, release)
//   --count N (1; groups: 20)  --body-prefix S ("m": bodies m0, m1, ...)
//   --groups G (0; groups: 4)  message i is in group <group-prefix><i % G> with
//              group-sequence floor(i / G)
//   --group-prefix S ("g")     --durable (header.durable = true)
//   --messages JSON            explicit list of messages instead of the generated ones:
//        [{"body": ..., "application_properties": {...}, "message_annotations": {...},
//          "group_id": "g", "group_sequence": 0, "durable": true, "to": "q",
//          "subject": "...", "message_id": ..., "priority": 4, ...}, ...]
//        typed values: {"$long": 5}, {"$int": -1}, {"$uint": 7}, {"$ulong": 9},
//        {"$short": 1}, {"$ubyte": 1}, {"$double": 1.5}, {"$float": 1.5},
//        {"$symbol": "s"}, {"$binary": "<hex>"}, {"$timestamp": <ms>};
//        body only: {"$data": "<hex>"} (a data section)
//   --raw      also print the exact message bytes ("raw", hex): as encoded when sent,
//              as received when received
// Receiving (receive)
//   --credit C (= count)  --expect-empty (after N messages drain the link and fail if
//   anything else arrives)  --ready (print {"event":"ready"} once the receiver is
//   attached and its credit is known to the broker)
// anonymous
//   --to A,B,...  destinations, message i goes to the (i % n)-th (default: --address)
//   --missing-to  also send one message without `to` (the broker must reject it)
//// selector   --selector S   --expect-refused
// durable-sub, shared-sub   --sub NAME (subscription name)   --unsubscribe-by-name
//   --global (shared-sub: global shared subscription)
//
// Received values are printed as JSON; values JSON cannot show are tagged:
// binary {"$binary": hex}, data section {"$data": hex}, timestamp {"$timestamp": ms}.
'use strict';

const rhea = require('rhea');

const USAGE =
    'usage: node rhea_client.js <send|receive|roundtrip|groups|dynamic|anonymous|release|' +
    'selector|no-local|temp-queue|temp-topic|durable-sub|shared-sub|browse|drain|prefetch0|' +
    'txn|echo> ' +
    '--port P [--address A] [--count N] [--timeout S] [...] (see the header of this file)';

// --------------------------------------------------------------------- errors, exit

class CheckFailed extends Error {}
class UsageError extends Error {}

function out(obj) {
    process.stdout.write(JSON.stringify(obj) + '\n');
}

// ---------------------------------------------------------------- argument parsing

const FLAGS = new Set([
    'durable', 'raw', 'expect-empty', 'ready', 'missing-to', 'sasl-anonymous',
    'expect-refused', 'unsubscribe-by-name', 'global', 'websocket',
]);
const VALUES = new Set([
    'host', 'port', 'address', 'count', 'timeout', 'username', 'password', 'container-id',
    'body-prefix', 'groups', 'group-prefix', 'messages', 'credit', 'to', 'selector', 'sub',
    'ca',
]);

function parseArgs(argv) {
    if (argv.length === 0 || argv[0].startsWith('--')) throw new UsageError('missing scenario');
    const opts = {scenario: argv[0]};
    for (let i = 1; i < argv.length; i++) {
        const a = argv[i];
        if (!a.startsWith('--')) throw new UsageError(`unexpected argument ${JSON.stringify(a)}`);
        const key = a.slice(2);
        if (FLAGS.has(key)) {
            opts[key] = true;
        } else if (VALUES.has(key)) {
            if (i + 1 >= argv.length) throw new UsageError(`${a} needs a value`);
            opts[key] = argv[++i];
        } else {
            throw new UsageError(`unknown option ${a}`);
        }
    }
    return opts;
}

function intOpt(opts, key, dflt) {
    if (opts[key] === undefined) return dflt;
    const n = Number(opts[key]);
    if (!Number.isInteger(n) || n < 0) throw new UsageError(`--${key} must be an integer >= 0`);
    return n;
}

// ------------------------------------------------------------ JSON <-> AMQP values

const TYPED = {
    $long: (v) => rhea.types.wrap_long(v),
    $int: (v) => rhea.types.wrap_int(v),
    $uint: (v) => rhea.types.wrap_uint(v),
    $ulong: (v) => rhea.types.wrap_ulong(v),
    $short: (v) => rhea.types.wrap_short(v),
    $ubyte: (v) => rhea.types.wrap_ubyte(v),
    $double: (v) => rhea.types.wrap_double(v),
    $float: (v) => rhea.types.wrap_float(v),
    $symbol: (v) => rhea.types.wrap_symbol(v),
    $binary: (v) => Buffer.from(v, 'hex'),
    $timestamp: (v) => rhea.types.wrap_timestamp(v),
};

function fromJson(v) {
    if (Array.isArray(v)) return v.map(fromJson);
    if (v !== null && typeof v === 'object') {
        const keys = Object.keys(v);
        if (keys.length === 1 && keys[0].startsWith('$')) {
            const f = TYPED[keys[0]];
            if (!f) throw new UsageError(`unknown typed value ${keys[0]}`);
            return f(v[keys[0]]);
        }
        const o = {};
        for (const k of keys) o[k] = fromJson(v[k]);
        return o;
    }
    return v;
}

function toJson(v) {
    if (v === undefined || v === null) return null;
    if (typeof v === 'bigint') return v.toString();
    if (Buffer.isBuffer(v)) return {$binary: v.toString('hex')};
    if (v instanceof Date) return {$timestamp: v.getTime()};
    if (Array.isArray(v)) return v.map(toJson);
    if (typeof v === 'object') {
        if (v.typecode === 0x75 && v.content !== undefined) {
            // a data section body (rhea's Section)
            return v.multiple ? v.content.map((b) => ({$data: b.toString('hex')}))
                : {$data: v.content.toString('hex')};
        }
        if (v.typecode === 0x76 && v.content !== undefined) return {$sequence: toJson(v.content)};
        const o = {};
        for (const k of Object.keys(v)) o[k] = toJson(v[k]);
        return o;
    }
    return v;
}

// A filter value as received: {"descriptor": "0x...", "value": ...} when described.
function filterValueJson(v) {
    if (v && v.descriptor !== undefined && v.value !== undefined && typeof v.type === 'object') {
        const d = v.descriptor.value;
        const descriptor = typeof d === 'number' ? '0x' + d.toString(16).padStart(16, '0')
            : Buffer.isBuffer(d) ? '0x' + d.toString('hex') : String(d);
        return {descriptor, value: toJson(rhea.types.unwrap(v.value))};
    }
    return toJson(v);
}

// A source terminus as the broker sent it (null when it is absent).
function sourceJson(src) {
    // rhea keeps a null source as a typed null
    if (!src || (src.type && src.type.name === 'Null')) return null;
    const filter = src.filter ? {} : null;
    if (src.filter) {
        for (const k of Object.keys(src.filter)) filter[k] = filterValueJson(src.filter[k]);
    }
    return {
        address: toJson(src.address),
        durable: toJson(src.durable),
        expiry_policy: toJson(src.expiry_policy),
        dynamic: Boolean(src.dynamic),
        distribution_mode: toJson(src.distribution_mode),
        capabilities: toJson(src.capabilities) || [],
        filter,
    };
}

const SELECTOR_DESCRIPTOR = 0x468C00000004;
const NO_LOCAL_DESCRIPTOR = 0x468C00000003;
// lifetime-policy delete-on-close (AMQP 1.0, 3.5.10)
const DELETE_ON_CLOSE = 0x2b;

function selectorFilter(selector) {
    return {'jms-selector': rhea.types.wrap_described(selector, SELECTOR_DESCRIPTOR)};
}

function noLocalFilter() {
    return {'no-local': rhea.types.wrap_described([], NO_LOCAL_DESCRIPTOR)};
}

// ------------------------------------------------ capture the raw bytes we receive

// rhea decodes each complete transfer with message.decode and dispatches the 'message'
// event synchronously afterwards; keep the exact bytes on the decoded message.
const originalDecode = rhea.message.decode;
rhea.message.decode = function (buffer) {
    const msg = originalDecode.call(this, buffer);
    Object.defineProperty(msg, '__raw', {value: Buffer.from(buffer), enumerable: false});
    return msg;
};

// ------------------------------------------------------------------------- waiting

let TIMEOUT_MS = 10000;
let fatal = null;
let shuttingDown = false;
const pending = new Set();

function kick() {
    for (const p of [...pending]) p.check();
}

function fail(err) {
    if (shuttingDown) return;
    if (fatal === null) fatal = err;
    kick();
}

// Resolves with cond()'s value once it is truthy; rejects on a fatal error (refused
// link, lost connection, ...) or after the timeout, naming what it waited for.
function until(cond, label, timeoutMs = TIMEOUT_MS) {
    return new Promise((resolve, reject) => {
        const p = {
            check() {
                if (fatal !== null && !shuttingDown) {
                    done();
                    reject(fatal);
                    return;
                }
                let v;
                try {
                    v = cond();
                } catch (e) {
                    done();
                    reject(e);
                    return;
                }
                if (v) {
                    done();
                    resolve(v);
                }
            },
        };
        const timer = setTimeout(() => {
            done();
            reject(new Error(`timed out after ${timeoutMs / 1000}s waiting for ${label}`));
        }, timeoutMs);
        function done() {
            clearTimeout(timer);
            pending.delete(p);
        }
        pending.add(p);
        p.check();
    });
}

function errorText(e) {
    if (!e) return 'no error condition';
    const cond = e.condition !== undefined ? e.condition : e.name;
    return `${cond}: ${e.description !== undefined ? e.description : e.message}`;
}

// -------------------------------------------------------------------- connections

const connections = [];

async function connect(opts, role, containerId) {
    const container = rhea.create_container({
        id: containerId || opts['container-id'] || `rhea-interop-${role}-${process.pid}`,
    });
    const options = {
        host: opts.host || '127.0.0.1',
        port: intOpt(opts, 'port', undefined),
        reconnect: false,
    };
    if (opts.username !== undefined) {
        options.username = opts.username;
        options.password = opts.password;
    } else if (opts['sasl-anonymous']) {
        options.username = 'anonymous';
    }
    if (opts.websocket) {
        const scheme = opts.ca !== undefined ? 'wss' : 'ws';
        const url = `${scheme}://${options.host}:${options.port}/`;
        const wsOptions = opts.ca !== undefined ? {ca: require('fs').readFileSync(opts.ca)} : {};
        options.connection_details =
            container.websocket_connect(require('ws'))(url, ['amqp'], wsOptions);
    }
    const c = {role, opened: false, closed: false, closing: false};
    const conn = container.connect(options);
    c.conn = conn;
    conn.on('connection_open', (ctx) => {
        c.opened = true;
        const remote = ctx.connection.remote.open || {};
        out({
            event: 'connected',
            role,
            container_id: remote.container_id,
            offered_capabilities: toJson(remote.offered_capabilities) || [],
            properties: toJson(remote.properties) || {},
        });
        kick();
    });
    conn.on('connection_error', (ctx) => {
        fail(new Error(`connection ${role} closed with an error: ` +
            errorText(ctx.error || ctx.connection.error)));
    });
    conn.on('connection_close', () => {
        c.closed = true;
        if (!c.closing) fail(new Error(`connection ${role} closed by the broker`));
        kick();
    });
    conn.on('disconnected', (ctx) => {
        c.closed = true;
        if (!c.closing) fail(new Error(`connection ${role} lost: ${ctx.error ? ctx.error.message : 'socket closed'}`));
        kick();
    });
    conn.on('protocol_error', (err) => fail(new Error(`protocol error on ${role}: ${err.message || err}`)));
    conn.on('error', (ctx) => fail(new Error(`error on ${role}: ${errorText(ctx.error)}`)));
    container.on('error', (err) => fail(new Error(`error on ${role}: ${errorText(err)}`)));
    connections.push(c);
    if (options.port === undefined) throw new UsageError('--port is required');
    await until(() => c.opened, `the broker's open on connection ${role}`);
    return c;
}

// A round trip on the connection (begin a session, wait for the broker's begin): every
// frame written before it on this connection has been processed by the broker.
async function sync(c) {
    const ssn = c.conn.create_session();
    let open = false;
    ssn.on('session_open', () => {
        open = true;
        kick();
    });
    ssn.on('session_error', (ctx) => fail(new Error(`session refused: ${errorText(ctx.session.error)}`)));
    ssn.begin();
    await until(() => open, `a session round trip on connection ${c.role}`);
    ssn.close();
}

// Closes one connection (before the end of the scenario) and waits for the broker's
// close or the end of the socket.
async function closeConnection(c) {
    if (c.closed) return;
    c.closing = true;
    const sock = c.conn.socket;
    if (sock && !sock.destroyed && typeof sock.once === 'function') {
        sock.once('close', () => {
            c.closed = true;
            kick();
        });
    }
    c.conn.close();
    await until(() => c.closed, `the broker to close connection ${c.role}`);
}

// Closes every connection and waits for the broker's close (or the end of the socket).
async function closeAll() {
    shuttingDown = true;
    for (const c of connections) {
        if (c.closed) continue;
        const sock = c.conn.socket;
        if (!sock || sock.destroyed) {
            c.closed = true;
            continue;
        }
        if (typeof sock.once === 'function') {  // a WebSocket: connection_close says it
            sock.once('close', () => {
                c.closed = true;
                kick();
            });
        }
        c.conn.close();
    }
    await until(() => connections.every((c) => c.closed), 'the broker to close the connections');
}

// -------------------------------------------------------------------------- links

function linkError(link, what) {
    return new Error(`${what} closed by the broker: ${errorText(link.error)}`);
}

// Waits until rhea dropped a link the peer detached (it does so on the next ticks):
// a new link of the same name on the same session must not meet the old one.
async function forgotten(link) {
    for (let i = 0; i < 100 && link.session.links[link.name] === link; i++) {
        await new Promise((resolve) => setTimeout(resolve, 1));
    }
}

class Tx {
    constructor(c, target, label, extra) {
        this.label = label;
        this.opened = false;
        this.closing = false;
        this.remoteDetach = null;
        this.results = new Map(); // delivery -> {index, outcome, remote_settled, error}
        this.settledCount = 0;
        const options = {target, autosettle: true, treat_modified_as_released: false};
        if (extra && extra.name) options.name = extra.name;
        this.link = c.conn.open_sender(options);
        const l = this.link;
        l.on('sender_open', () => {
            this.opened = true;
            kick();
        });
        const onDetach = () => {
            if (this.closing || (extra && extra.refusable)) {
                this.remoteDetach = {closed: Boolean(l.remote.detach.closed), error: l.error};
                kick();
            } else {
                fail(linkError(l, `sender ${label}`));
            }
        };
        l.on('sender_error', onDetach);
        l.on('sender_close', onDetach);
        l.on('sendable', kick);
        for (const outcome of ['accepted', 'rejected', 'released', 'modified']) {
            l.on(outcome, (ctx) => this.record(ctx.delivery, outcome));
        }
        l.on('settled', (ctx) => this.record(ctx.delivery, null));
    }

    record(d, outcome) {
        const r = this.results.get(d);
        if (r === undefined) {
            kick(); // a delivery sent outside sendAll / sendOne (transactions)
            return;
        }
        if (outcome !== null) {
            r.outcome = outcome;
            const st = d.remote_state;
            if (st && st.error) r.error = st.error;
            if (st && outcome === 'modified') {
                r.delivery_failed = Boolean(st.delivery_failed);
                r.undeliverable_here = Boolean(st.undeliverable_here);
            }
        }
        if (d.remote_settled) r.remote_settled = true;
        if (r.outcome && r.remote_settled && !r.done) {
            r.done = true;
            this.settledCount++;
            const line = {event: 'settled', sender: this.label, index: r.index, outcome: r.outcome};
            if (r.to !== undefined) line.to = r.to;
            if (r.error) {
                line.condition = toJson(r.error.condition);
                line.description = toJson(r.error.description);
            }
            if (r.delivery_failed !== undefined) {
                line.delivery_failed = r.delivery_failed;
                line.undeliverable_here = r.undeliverable_here;
            }
            if (r.raw) line.raw = r.raw;
            out(line);
        }
        kick();
    }

    async open() {
        await until(() => this.opened, `the broker's attach of sender ${this.label}`);
    }

    get address() {
        const t = this.link.target;
        return t ? t.address : undefined;
    }

    // Closes the link (detach closed=true) and waits for the broker's detach.
    async close() {
        this.closing = true;
        this.link.close();
        await until(() => this.remoteDetach, `the broker's detach of sender ${this.label}`);
        await forgotten(this.link);
        return this.remoteDetach;
    }

    // Sends one message; resolves with its outcome, or 'detached' if the broker detached
    // the link instead (a sender made with {refusable: true}).
    async sendOne(m) {
        await until(() => this.remoteDetach || this.link.sendable(), `credit for sender ${this.label}`);
        const detached = () => ({outcome: 'detached',
            condition: this.remoteDetach.error ? toJson(this.remoteDetach.error.condition) : null,
            description: this.remoteDetach.error ? toJson(this.remoteDetach.error.description) : null});
        if (this.remoteDetach) return detached();
        const d = this.link.send(rhea.message.encode(m), undefined, 0);
        const r = {index: this.results.size, outcome: null, remote_settled: false, done: false};
        this.results.set(d, r);
        await until(() => r.done || this.remoteDetach, `the broker to settle a message on ${this.label}`);
        if (!r.done) return detached();
        return {outcome: r.outcome, condition: r.error ? toJson(r.error.condition) : null,
            description: r.error ? toJson(r.error.description) : null};
    }

    // Sends each message when credit allows, then waits until the broker settled all.
    async sendAll(messages, raw, indexBase = 0) {
        const start = this.settledCount;
        for (let i = 0; i < messages.length; i++) {
            await until(() => this.link.sendable(), `credit for sender ${this.label}`);
            const bytes = rhea.message.encode(messages[i]);
            const d = this.link.send(bytes, undefined, 0);
            const r = {index: indexBase + i, outcome: null, remote_settled: false, done: false};
            if (messages[i].to !== undefined) r.to = messages[i].to;
            if (raw) r.raw = bytes.toString('hex');
            this.results.set(d, r);
        }
        await until(() => this.settledCount - start === messages.length,
            `the broker to settle ${messages.length} message(s) on sender ${this.label}`);
        const outcomes = {};
        for (const r of this.results.values()) {
            if (r.index >= indexBase && r.index < indexBase + messages.length) {
                outcomes[r.outcome] = (outcomes[r.outcome] || 0) + 1;
            }
        }
        return outcomes;
    }
}

class Rx {
    // extra: {name: link name, refusable: a detach with an error is recorded (refused)
    // instead of ending the scenario}
    constructor(c, source, label, extra) {
        extra = extra || {};
        this.label = label;
        this.opened = false;
        this.drained = false;
        this.queue = [];
        this.received = 0;
        this.granted = 0;
        this.closing = false;
        this.remoteDetach = null;
        const options = {autoaccept: false, credit_window: 0};
        if (source !== undefined) options.source = source;
        if (extra.name) options.name = extra.name;
        this.link = c.conn.open_receiver(options);
        const l = this.link;
        l.on('receiver_open', () => {
            this.opened = true;
            kick();
        });
        const onDetach = () => {
            if (this.closing || extra.refusable) {
                this.remoteDetach = {closed: Boolean(l.remote.detach.closed), error: l.error};
                kick();
            } else {
                fail(linkError(l, `receiver ${label}`));
            }
        };
        l.on('receiver_error', onDetach);
        l.on('receiver_close', onDetach);
        l.on('message', (ctx) => {
            this.received++;
            this.queue.push({message: ctx.message, delivery: ctx.delivery});
            kick();
        });
        l.on('receiver_drained', () => {
            this.drained = true;
            kick();
        });
    }

    get address() {
        const s = this.link.source;
        return s ? s.address : undefined;
    }

    async open() {
        await until(() => this.opened, `the broker's attach of receiver ${this.label}`);
    }

    flow(n) {
        if (n > 0) {
            this.granted += n;
            this.link.flow(n);
        }
    }

    // The broker's view of the source (null when it attached with a null source).
    sourceJson() {
        return sourceJson(this.link.source);
    }

    async detach() {
        this.closing = true;
        this.link.detach();
        await until(() => this.remoteDetach, `the broker's detach of receiver ${this.label}`);
        await forgotten(this.link);
        return this.remoteDetach;
    }

    async close() {
        this.closing = true;
        this.link.close();
        await until(() => this.remoteDetach, `the broker's detach of receiver ${this.label}`);
        await forgotten(this.link);
        return this.remoteDetach;
    }

    // Drain with `credit` more credit (0: only the credit the link has): resolves with
    // every message that arrived before the broker reported the link drained, or before
    // the messages used up the credit (a sender need not answer a drain then).
    async drainAll(credit) {
        this.drained = false;
        this.link.drain = true;
        if (credit > 0) {
            this.granted += credit;
            this.link.flow(credit);
        } else {
            this.link.drain_credit();
        }
        await until(() => this.drained || this.link.credit === 0,
            `the broker to answer a drain on receiver ${this.label}`);
        this.link.drain = false;
        return this.queue.splice(0, this.queue.length);
    }

    async next(what) {
        await until(() => this.queue.length > 0,
            `${what || 'a message'} on receiver ${this.label} (received ${this.received} so far)`);
        return this.queue.shift();
    }

    // Drain with 1 credit: resolves null if the broker reports the link drained, or
    // the message that arrived instead.
    async drainOne() {
        this.drained = false;
        this.link.drain = true;
        this.granted += 1;
        this.link.flow(1);
        await until(() => this.drained || this.queue.length > 0,
            `the broker to answer a drain on receiver ${this.label}`);
        this.link.drain = false;
        return this.queue.length > 0 ? this.queue.shift() : null;
    }
}

function describe(item, raw, extra) {
    const m = item.message;
    const line = Object.assign({event: 'message'}, extra || {});
    line.body = toJson(m.body);
    line.group_id = toJson(m.group_id);
    line.group_sequence = toJson(m.group_sequence);
    // header.delivery-count: an absent header / field means 0
    line.delivery_count = m.delivery_count === undefined ? 0 : m.delivery_count;
    line.durable = Boolean(m.durable);
    line.to = toJson(m.to);
    line.subject = toJson(m.subject);
    line.message_id = toJson(m.message_id);
    line.application_properties = toJson(m.application_properties) || {};
    line.message_annotations = toJson(m.message_annotations) || {};
    if (raw) line.raw = m.__raw.toString('hex');
    return line;
}

// ----------------------------------------------------------------------- messages

function buildMessages(opts, dflt) {
    if (opts.messages !== undefined) {
        let list;
        try {
            list = JSON.parse(opts.messages);
        } catch (e) {
            throw new UsageError(`--messages is not valid JSON: ${e.message}`);
        }
        if (!Array.isArray(list)) throw new UsageError('--messages must be a JSON array');
        return list.map((spec) => {
            const m = {};
            for (const k of Object.keys(spec)) {
                if (k === 'body' && spec.body !== null && typeof spec.body === 'object' &&
                    Object.keys(spec.body).length === 1 && spec.body.$data !== undefined) {
                    m.body = rhea.message.data_section(Buffer.from(spec.body.$data, 'hex'));
                } else {
                    m[k] = fromJson(spec[k]);
                }
            }
            return m;
        });
    }
    const count = intOpt(opts, 'count', dflt.count);
    const groups = intOpt(opts, 'groups', dflt.groups || 0);
    const prefix = opts['body-prefix'] !== undefined ? opts['body-prefix'] : 'm';
    const gprefix = opts['group-prefix'] !== undefined ? opts['group-prefix'] : 'g';
    const list = [];
    for (let i = 0; i < count; i++) {
        const m = {body: `${prefix}${i}`, application_properties: {index: i, client: 'rhea'}};
        if (groups > 0) {
            m.group_id = `${gprefix}${i % groups}`;
            m.group_sequence = Math.floor(i / groups);
        }
        if (opts.durable) m.durable = true;
        list.push(m);
    }
    return list;
}

// the body as a receiver will see it (encode, decode)
function expectedBody(m) {
    return toJson(originalDecode.call(rhea.message, rhea.message.encode(m)).body);
}

function sameJson(a, b) {
    return JSON.stringify(a) === JSON.stringify(b);
}

// ---------------------------------------------------------------------- scenarios

async function scenarioSend(opts) {
    const address = opts.address || 'rhea.interop';
    const messages = buildMessages(opts, {count: 1});
    const c = await connect(opts, 'sender');
    const tx = new Tx(c, {address}, 'tx');
    await tx.open();
    const outcomes = await tx.sendAll(messages, opts.raw);
    out({event: 'send_done', address, count: messages.length, outcomes});
}

async function receiveN(rx, n, opts, extra) {
    const got = [];
    for (let i = 0; i < n; i++) {
        const item = await rx.next(`message ${i + 1} of ${n}`);
        out(describe(item, opts.raw, Object.assign({receiver: rx.label, index: i}, extra || {})));
        item.delivery.accept();
        got.push(item);
    }
    return got;
}

async function expectEmpty(rx) {
    const extra = await rx.drainOne();
    if (extra !== null) {
        out(describe(extra, false, {receiver: rx.label, unexpected: true}));
        extra.delivery.release();
        throw new CheckFailed(`receiver ${rx.label}: an unexpected extra message arrived`);
    }
    out({event: 'drained', receiver: rx.label});
}

async function scenarioReceive(opts) {
    const address = opts.address || 'rhea.interop';
    const count = intOpt(opts, 'count', 1);
    const credit = intOpt(opts, 'credit', count);
    const c = await connect(opts, 'receiver');
    const rx = new Rx(c, {address}, 'rx');
    rx.flow(credit);
    await rx.open();
    if (opts.ready) {
        await sync(c);
        out({event: 'ready', address: rx.address});
    }
    await receiveN(rx, count, opts);
    if (opts['expect-empty']) await expectEmpty(rx);
    out({event: 'receive_done', address, count});
}

async function scenarioRoundtrip(opts) {
    const address = opts.address || 'rhea.interop';
    const messages = buildMessages(opts, {count: 1});
    const c = await connect(opts, 'client');
    const tx = new Tx(c, {address}, 'tx');
    await tx.open();
    const outcomes = await tx.sendAll(messages, opts.raw);
    const rx = new Rx(c, {address}, 'rx');
    rx.flow(messages.length);
    await rx.open();
    const got = await receiveN(rx, messages.length, opts);
    const bodies = got.map((g) => toJson(g.message.body));
    const expected = messages.map(expectedBody);
    out({event: 'roundtrip_done', address, count: got.length, outcomes,
        in_order: sameJson(bodies, expected)});
    if (!sameJson(bodies, expected)) {
        throw new CheckFailed(`bodies differ: sent ${JSON.stringify(expected)}, ` +
            `received ${JSON.stringify(bodies)}`);
    }
}

async function scenarioGroups(opts) {
    const address = opts.address || 'rhea.groups';
    const messages = buildMessages(opts, {count: 20, groups: 4});
    const n = messages.length;
    const rxs = [];
    // attach the receivers one after the other, each with credit for every message and
    // known to the broker before the next one attaches (and before anything is sent)
    for (const label of ['r1', 'r2']) {
        const c = await connect(opts, label);
        const rx = new Rx(c, {address}, label);
        rx.flow(n);
        await rx.open();
        await sync(c);
        rxs.push(rx);
    }
    const cs = await connect(opts, 'sender');
    const tx = new Tx(cs, {address}, 'tx');
    await tx.open();
    const outcomes = await tx.sendAll(messages, opts.raw);
    await until(() => rxs.reduce((a, r) => a + r.received, 0) >= n,
        `${n} messages over both receivers`);
    const lines = [];
    for (const rx of rxs) {
        let i = 0;
        while (rx.queue.length) {
            const item = rx.queue.shift();
            const line = describe(item, opts.raw, {receiver: rx.label, index: i++});
            out(line);
            lines.push(line);
            item.delivery.accept();
        }
    }
    // checks: every message exactly once; each group at one receiver, in send order
    const problems = [];
    const assignment = {};
    const counts = {r1: 0, r2: 0};
    const position = new Map(messages.map((m, i) => [JSON.stringify(expectedBody(m)), i]));
    const lastIndex = {};
    const seen = new Set();
    for (const line of lines) {
        counts[line.receiver]++;
        const key = JSON.stringify(line.body);
        if (!position.has(key)) problems.push(`unknown message ${key}`);
        if (seen.has(key)) problems.push(`message ${key} received twice`);
        seen.add(key);
        const g = line.group_id;
        if (g === null) continue;
        if (assignment[g] === undefined) assignment[g] = line.receiver;
        else if (assignment[g] !== line.receiver) {
            problems.push(`group ${g} went to ${assignment[g]} and ${line.receiver}`);
        }
        const pos = position.get(key);
        if (lastIndex[g] !== undefined && pos < lastIndex[g]) {
            problems.push(`group ${g}: message ${key} arrived after a later one`);
        }
        lastIndex[g] = pos;
    }
    if (seen.size !== n) problems.push(`received ${seen.size} distinct messages, sent ${n}`);
    out({event: 'groups_done', address, count: lines.length, outcomes, assignment, counts,
        ok: problems.length === 0, problems});
    if (problems.length) throw new CheckFailed(problems.join('; '));
}

async function scenarioDynamic(opts) {
    const messages = buildMessages(opts, {count: 1});
    const c = await connect(opts, 'client');
    const rx = new Rx(c, {dynamic: true}, 'rx');
    rx.flow(messages.length);
    await rx.open();
    const address = rx.address;
    out({event: 'dynamic', address: toJson(address)});
    if (!address) throw new CheckFailed('the broker gave the dynamic receiver no address');
    const tx = new Tx(c, {address}, 'tx');
    await tx.open();
    const outcomes = await tx.sendAll(messages, opts.raw);
    const got = await receiveN(rx, messages.length, opts);
    const bodies = got.map((g) => toJson(g.message.body));
    const expected = messages.map(expectedBody);
    out({event: 'dynamic_done', address, count: got.length, outcomes,
        in_order: sameJson(bodies, expected)});
    if (!sameJson(bodies, expected)) {
        throw new CheckFailed(`bodies differ: sent ${JSON.stringify(expected)}, ` +
            `received ${JSON.stringify(bodies)}`);
    }
}

async function scenarioAnonymous(opts) {
    const dests = (opts.to || opts.address || 'rhea.anon.a,rhea.anon.b').split(',').filter(Boolean);
    const messages = buildMessages(opts, {count: 4});
    messages.forEach((m, i) => {
        if (m.to === undefined) m.to = dests[i % dests.length];
    });
    const c = await connect(opts, 'client');
    const tx = new Tx(c, {}, 'tx'); // null target address: anonymous relay
    await tx.open();
    const outcomes = await tx.sendAll(messages, opts.raw);
    if (opts['missing-to']) {
        const extra = await tx.sendAll([{body: 'no-to'}], opts.raw, messages.length);
        for (const k of Object.keys(extra)) outcomes[k] = (outcomes[k] || 0) + extra[k];
    }
    const received = {};
    for (const dest of dests) {
        const want = messages.filter((m) => m.to === dest).length;
        const rx = new Rx(c, {address: dest}, dest);
        rx.flow(want);
        await rx.open();
        const got = await receiveN(rx, want, opts, {address: dest});
        received[dest] = got.map((g) => toJson(g.message.body));
        const expected = messages.filter((m) => m.to === dest).map(expectedBody);
        if (!sameJson(received[dest], expected)) {
            throw new CheckFailed(`${dest}: expected ${JSON.stringify(expected)}, ` +
                `received ${JSON.stringify(received[dest])}`);
        }
    }
    out({event: 'anonymous_done', outcomes, received});
}

async function scenarioRelease(opts) {
    const address = opts.address || 'rhea.release';
    const messages = buildMessages(opts, {count: 1}).slice(0, 1);
    const c = await connect(opts, 'client');
    const tx = new Tx(c, {address}, 'tx');
    await tx.open();
    await tx.sendAll(messages, opts.raw);
    const body = expectedBody(messages[0]);
    const rx = new Rx(c, {address}, 'rx');
    rx.flow(1);
    await rx.open();
    const problems = [];
    const steps = [
        // [step, settle the delivery, expected delivery-count]
        ['first', (d) => d.release(), 0],
        ['after_release', (d) => d.release({delivery_failed: true}), 0],
        ['after_modified', (d) => d.modified({delivery_failed: true, undeliverable_here: false}), 1],
        ['after_second_modified', (d) => d.accept(), 2],
    ];
    for (const [step, settle, expectedCount] of steps) {
        const item = await rx.next(`the message (${step})`);
        const line = describe(item, opts.raw, {receiver: 'rx', step,
            expected_delivery_count: expectedCount});
        out(line);
        if (line.delivery_count !== expectedCount) {
            problems.push(`${step}: delivery_count ${line.delivery_count}, expected ${expectedCount}`);
        }
        if (!sameJson(line.body, body)) problems.push(`${step}: body ${JSON.stringify(line.body)}`);
        settle(item.delivery);
        if (step !== 'after_second_modified') rx.flow(1);
    }
    await expectEmpty(rx);
    out({event: 'release_done', address, ok: problems.length === 0, problems});
    if (problems.length) throw new CheckFailed(problems.join('; '));
}

// ------------------------------------------------------- JMS-style scenarios

function bodiesOf(items) {
    return items.map((g) => toJson(g.message.body));
}

// Prints every message (one line each, indexed from `start`) and accepts it.
function printAccept(items, rx, opts, extra, start) {
    items.forEach((item, i) => {
        out(describe(item, opts.raw,
            Object.assign({receiver: rx.label, index: (start || 0) + i}, extra || {})));
        item.delivery.accept();
    });
}

function withPrefix(opts, prefix, dfltCount) {
    return buildMessages(Object.assign({}, opts, {'body-prefix': prefix}), {count: dfltCount});
}

// The broker's answer to an attach that may be refused: waits for its attach, then a
// session round trip, so that a detach sent right after the attach has arrived too.
async function attachOutcome(c, link) {
    await until(() => link.opened || link.remoteDetach,
        `the broker's answer to the attach of ${link.label}`);
    await sync(c);
    const d = link.remoteDetach;
    if (d && d.error) {
        return {refused: true, condition: toJson(d.error.condition),
            description: toJson(d.error.description)};
    }
    if (d) return {refused: true, condition: null, description: null};
    return {refused: false};
}

async function scenarioSelector(opts) {
    const address = opts.address || 'rhea.selector';
    const selector = opts.selector;
    if (selector === undefined) throw new UsageError('selector needs --selector');
    const c = await connect(opts, 'client');
    if (opts['expect-refused']) {
        const rx = new Rx(c, {address, filter: selectorFilter(selector)}, 'sel',
            {refusable: true});
        rx.flow(1);
        const r = await attachOutcome(c, rx);
        out(Object.assign({event: r.refused ? 'refused' : 'attached', receiver: 'sel',
            source: rx.opened ? rx.sourceJson() : null}, r));
        if (!r.refused) throw new CheckFailed(`the broker attached a receiver with selector ${selector}`);
        return;
    }
    const messages = buildMessages(opts, {count: 6});
    const half = Math.floor(messages.length / 2);
    const tx = new Tx(c, {address}, 'tx');
    await tx.open();
    // half of the messages wait in the queue, the other half arrive after the attach
    const outcomes = await tx.sendAll(messages.slice(0, half), opts.raw);
    const rx = new Rx(c, {address, filter: selectorFilter(selector)}, 'sel');
    await rx.open();
    out({event: 'attached', receiver: 'sel', source: rx.sourceJson()});
    const more = await tx.sendAll(messages.slice(half), opts.raw, half);
    for (const k of Object.keys(more)) outcomes[k] = (outcomes[k] || 0) + more[k];
    const selected = await rx.drainAll(messages.length + 1);
    printAccept(selected, rx, opts);
    await rx.close();
    const rest = new Rx(c, {address}, 'rest');
    await rest.open();
    const others = await rest.drainAll(messages.length + 1);
    printAccept(others, rest, opts);
    out({event: 'selector_done', address, selector, outcomes, selected: bodiesOf(selected),
        rest: bodiesOf(others)});
}

async function scenarioNoLocal(opts) {
    const topic = opts.address || 'rhea.topic.nolocal';
    const ca = await connect(opts, 'A');
    const cb = await connect(opts, 'B');
    const local = new Rx(ca, {address: topic, capabilities: ['topic'], filter: noLocalFilter()},
        'nolocal');
    await local.open();
    out({event: 'attached', receiver: 'nolocal', source: local.sourceJson()});
    const plain = new Rx(cb, {address: topic, capabilities: ['topic']}, 'plain');
    await plain.open();
    await sync(ca);
    await sync(cb);
    const txA = new Tx(ca, {address: topic, capabilities: ['topic']}, 'txA');
    const txB = new Tx(cb, {address: topic, capabilities: ['topic']}, 'txB');
    await txA.open();
    await txB.open();
    const fromA = withPrefix(opts, 'a', 3);
    const fromB = withPrefix(opts, 'b', 3);
    const outcomes = {A: await txA.sendAll(fromA, opts.raw), B: await txB.sendAll(fromB, opts.raw)};
    const n = fromA.length + fromB.length;
    const gotLocal = await local.drainAll(n + 1);
    printAccept(gotLocal, local, opts);
    const gotPlain = await plain.drainAll(n + 1);
    printAccept(gotPlain, plain, opts);
    out({event: 'no_local_done', topic, outcomes, nolocal: bodiesOf(gotLocal),
        plain: bodiesOf(gotPlain)});
}

function dynamicTarget(capability) {
    // what Qpid JMS sends to create a temporary destination
    return {
        dynamic: true,
        capabilities: [capability],
        expiry_policy: 'link-detach',
        dynamic_node_properties: {
            'lifetime-policy': rhea.types.wrap_described([], DELETE_ON_CLOSE),
        },
    };
}

// Attach a sender to `target` and send one message: reports a refused attach, or the
// outcome of the message.
async function probeSend(c, target, label) {
    const tx = new Tx(c, target, label, {refusable: true});
    const r = await attachOutcome(c, tx);
    if (r.refused) return Object.assign({attach: 'refused'}, r);
    const s = await tx.sendOne({body: 'probe'});
    return {attach: 'open', outcome: s.outcome, condition: s.condition,
        description: s.description};
}

async function scenarioTempQueue(opts) {
    const messages = buildMessages(opts, {count: 3});
    const c = await connect(opts, 'owner');
    const creator = new Tx(c, dynamicTarget('temporary-queue'), 'creator');
    await creator.open();
    const address = creator.address;
    out({event: 'temp_queue', address: toJson(address),
        target_capabilities: toJson(creator.link.target && creator.link.target.capabilities) || []});
    if (!address) throw new CheckFailed('the broker gave the temporary queue no address');
    const rx = new Rx(c, {address, capabilities: ['temporary-queue']}, 'rx');
    rx.flow(messages.length);
    await rx.open();
    // another connection replies to it
    const other = await connect(opts, 'other');
    const tx = new Tx(other, {address, capabilities: ['temporary-queue']}, 'tx');
    await tx.open();
    const outcomes = await tx.sendAll(messages, opts.raw);
    const got = await receiveN(rx, messages.length, opts);
    await expectEmpty(rx);
    await rx.close();
    await tx.close();
    const det = await creator.close();
    out({event: 'creator_closed', closed: det.closed,
        error: det.error ? errorText(det.error) : null});
    const probe = await probeSend(other, {address, capabilities: ['temporary-queue']}, 'probe');
    out(Object.assign({event: 'after_delete'}, probe));
    out({event: 'temp_queue_done', address, outcomes, received: bodiesOf(got)});
}

async function scenarioTempTopic(opts) {
    const messages = buildMessages(opts, {count: 3});
    const c = await connect(opts, 'owner');
    const creator = new Tx(c, dynamicTarget('temporary-topic'), 'creator');
    await creator.open();
    const address = creator.address;
    out({event: 'temp_topic', address: toJson(address),
        target_capabilities: toJson(creator.link.target && creator.link.target.capabilities) || []});
    if (!address) throw new CheckFailed('the broker gave the temporary topic no address');
    const rxs = [];
    for (const label of ['s1', 's2']) {
        const cs = await connect(opts, label);
        const rx = new Rx(cs, {address, capabilities: ['temporary-topic']}, label);
        rx.flow(messages.length);
        await rx.open();
        await sync(cs);
        rxs.push(rx);
    }
    const tx = new Tx(c, {address, capabilities: ['temporary-topic']}, 'tx');
    await tx.open();
    const outcomes = await tx.sendAll(messages, opts.raw);
    const received = {};
    for (const rx of rxs) {
        received[rx.label] = bodiesOf(await receiveN(rx, messages.length, opts));
        await expectEmpty(rx);
        await rx.close();
    }
    await tx.close();
    const det = await creator.close();
    out({event: 'creator_closed', closed: det.closed,
        error: det.error ? errorText(det.error) : null});
    const probe = await probeSend(c, {address, capabilities: ['temporary-topic']}, 'probe');
    out(Object.assign({event: 'after_delete'}, probe));
    out({event: 'temp_topic_done', address, outcomes, received});
}

async function scenarioDurableSub(opts) {
    const topic = opts.address || 'rhea.topic.durable';
    const sub = opts.sub || 'rhea-dsub';
    const clientId = opts['container-id'] || 'rhea-durable-client';
    // what Qpid JMS sends for a durable subscriber (AmqpConsumerBuilder)
    const source = {address: topic, capabilities: ['topic'], durable: 2,
        expiry_policy: 'never', distribution_mode: 'copy'};
    const cp = await connect(opts, 'publisher', `rhea-publisher-${process.pid}`);
    const tx = new Tx(cp, {address: topic, capabilities: ['topic']}, 'tx');
    await tx.open();
    const outcomes = {};
    let sent = 0;
    const publish = async (n, phase) => {
        const msgs = [];
        for (let i = 0; i < n; i++, sent++) msgs.push({body: `d${sent}`, application_properties: {index: sent}});
        const o = await tx.sendAll(msgs, false, sent - n);
        for (const k of Object.keys(o)) outcomes[k] = (outcomes[k] || 0) + o[k];
        out({event: 'published', phase, bodies: msgs.map((m) => m.body)});
    };
    const received = {};
    const subscribe = async (c, phase) => {
        const rx = new Rx(c, source, phase, {name: sub});
        rx.flow(10);
        await rx.open();
        out({event: 'attached', receiver: phase, link_name: sub, source: rx.sourceJson()});
        await sync(c);
        return rx;
    };

    // 1. subscribe, receive what is published while attached
    const c1 = await connect(opts, 'subscriber1', clientId);
    let rx = await subscribe(c1, 'first');
    await publish(2, 'attached');
    received.first = bodiesOf(await receiveN(rx, 2, opts, {phase: 'first'}));
    // 2. detach (JMS consumer.close() on a durable subscriber), end the connection
    let det = await rx.detach();
    out({event: 'detached', receiver: 'first', remote_closed: det.closed});
    await closeConnection(c1);
    await publish(2, 'detached');
    // 3. re-attach from a new connection with the same container id and link name
    const c2 = await connect(opts, 'subscriber2', clientId);
    rx = await subscribe(c2, 'reattached');
    received.reattached = await take(rx, 0, opts, 'reattached');
    // 4. unsubscribe
    if (opts['unsubscribe-by-name']) {
        det = await rx.detach();
        out({event: 'detached', receiver: 'reattached', remote_closed: det.closed});
        // Qpid JMS unsubscribe: attach with the subscription's link name and no source
        const un = new Rx(c2, undefined, 'unsubscribe', {name: sub, refusable: true});
        const r = await attachOutcome(c2, un);
        out(Object.assign({event: 'unsubscribe_attach', source: un.opened ? un.sourceJson() : null}, r));
        if (r.refused) throw new CheckFailed(`unsubscribe attach refused: ${r.condition} ${r.description}`);
        det = await un.close();
        out({event: 'closed', receiver: 'unsubscribe', remote_closed: det.closed,
            error: det.error ? errorText(det.error) : null});
    } else {
        det = await rx.close();
        out({event: 'closed', receiver: 'reattached', remote_closed: det.closed,
            error: det.error ? errorText(det.error) : null});
    }
    await publish(1, 'unsubscribed');
    // 5. the same name now makes a new, empty subscription
    rx = await subscribe(c2, 'fresh');
    received.fresh_before = await take(rx, 0, opts, 'fresh_before');
    await publish(1, 'fresh');
    received.fresh = await take(rx, 1, opts, 'fresh');
    det = await rx.close();
    out({event: 'closed', receiver: 'fresh', remote_closed: det.closed});
    out({event: 'durable_done', topic, sub, outcomes, received});
}

// Drains the receiver (`credit` more credit), prints and accepts what arrived.
async function take(rx, credit, opts, phase) {
    const got = await rx.drainAll(credit);
    printAccept(got, rx, opts, {phase});
    return bodiesOf(got);
}

async function scenarioSharedSub(opts) {
    const topic = opts.address || 'rhea.topic.shared';
    const sub = opts.sub || 'rhea-shared';
    const global = Boolean(opts.global);
    const messages = buildMessages(opts, {count: 10});
    const n = messages.length;
    const caps = global ? ['topic', 'shared', 'global'] : ['topic', 'shared'];
    const rxs = [];
    if (global) {
        // no client id: one connection each, each with its first global volatile link
        for (const label of ['s1', 's2']) {
            const c = await connect(opts, label, `rhea-shared-${label}-${process.pid}`);
            const rx = new Rx(c, {address: topic, capabilities: caps}, label,
                {name: `${sub}|global-volatile1`});
            rx.flow(n);
            await rx.open();
            await sync(c);
            out({event: 'attached', receiver: label, link_name: rx.link.name, source: rx.sourceJson()});
            rxs.push(rx);
        }
    } else {
        const c = await connect(opts, 'subscriber', opts['container-id'] || `rhea-shared-${process.pid}`);
        for (const [i, label] of ['s1', 's2'].entries()) {
            const rx = new Rx(c, {address: topic, capabilities: caps}, label,
                {name: `${sub}|volatile${i + 1}`});
            rx.flow(n);
            await rx.open();
            await sync(c);
            out({event: 'attached', receiver: label, link_name: rx.link.name, source: rx.sourceJson()});
            rxs.push(rx);
        }
    }
    const cp = await connect(opts, 'publisher');
    const plain = new Rx(cp, {address: topic, capabilities: ['topic']}, 'plain');
    plain.flow(n);
    await plain.open();
    await sync(cp);
    const tx = new Tx(cp, {address: topic, capabilities: ['topic']}, 'tx');
    await tx.open();
    const outcomes = await tx.sendAll(messages, opts.raw);
    const received = {};
    for (const rx of [...rxs, plain]) {
        const got = await rx.drainAll(0);
        printAccept(got, rx, opts);
        received[rx.label] = bodiesOf(got);
    }
    const problems = [];
    const seen = new Map();
    for (const rx of rxs) {
        for (const b of received[rx.label]) {
            const key = JSON.stringify(b);
            if (seen.has(key)) problems.push(`${key} went to ${seen.get(key)} and ${rx.label}`);
            seen.set(key, rx.label);
        }
    }
    const expected = messages.map(expectedBody);
    for (const b of expected) {
        if (!seen.has(JSON.stringify(b))) problems.push(`${JSON.stringify(b)} reached no shared receiver`);
    }
    for (const rx of rxs) {
        const det = await rx.close();
        if (det.error) problems.push(`closing ${rx.label}: ${errorText(det.error)}`);
    }
    out({event: 'shared_done', topic, sub, global, outcomes, received,
        counts: Object.fromEntries(rxs.map((rx) => [rx.label, received[rx.label].length])),
        ok: problems.length === 0, problems});
    if (problems.length) throw new CheckFailed(problems.join('; '));
}

async function scenarioBrowse(opts) {
    const address = opts.address || 'rhea.browse';
    const messages = buildMessages(opts, {count: 5});
    const n = messages.length;
    const c = await connect(opts, 'client');
    const tx = new Tx(c, {address}, 'tx');
    await tx.open();
    const outcomes = await tx.sendAll(messages, opts.raw);
    const result = {};
    for (const pass of ['browse1', 'browse2']) {
        const rx = new Rx(c, {address, distribution_mode: 'copy', capabilities: ['queue']}, pass);
        await rx.open();
        out({event: 'attached', receiver: pass, source: rx.sourceJson()});
        // a browser asks for more than there is and stops when the drain completes
        const got = await rx.drainAll(n + 1);
        printAccept(got, rx, opts);
        result[pass] = bodiesOf(got);
        await rx.close();
    }
    const rx = new Rx(c, {address}, 'consumer');
    await rx.open();
    const got = await rx.drainAll(n + 1);
    printAccept(got, rx, opts);
    result.consumed = bodiesOf(got);
    result.after = bodiesOf(await rx.drainAll(1));
    out(Object.assign({event: 'browse_done', address, outcomes}, result));
}

async function scenarioDrain(opts) {
    const address = opts.address || 'rhea.drain';
    const c = await connect(opts, 'client');
    const rx = new Rx(c, {address}, 'rx');
    await rx.open();
    await sync(c);
    const drain = async (phase, credit) => {
        const t0 = Date.now();
        const got = await rx.drainAll(credit);
        const line = {event: 'drain_result', phase, credit_given: credit, messages: bodiesOf(got),
            elapsed_ms: Date.now() - t0, credit: rx.link.credit,
            delivery_count: rx.link.delivery_count};
        out(line);
        got.forEach((g) => g.delivery.accept());
    };
    await drain('empty', 5);
    const tx = new Tx(c, {address}, 'tx');
    await tx.open();
    const outcomes = await tx.sendAll(buildMessages(opts, {count: 2}), opts.raw);
    await drain('two_messages', 5);
    await drain('empty_again', 1);
    out({event: 'drain_done', address, outcomes});
}

async function scenarioPrefetch0(opts) {
    const address = opts.address || 'rhea.prefetch0';
    const messages = buildMessages(opts, {count: 6});
    const ca = await connect(opts, 'A');
    const cb = await connect(opts, 'B');
    const rxs = [new Rx(ca, {address}, 'A'), new Rx(cb, {address}, 'B')];
    const conns = [ca, cb];
    for (const rx of rxs) await rx.open();
    await sync(ca);
    await sync(cb);
    const cs = await connect(opts, 'sender');
    const tx = new Tx(cs, {address}, 'tx');
    await tx.open();
    const outcomes = await tx.sendAll(messages, opts.raw);
    const problems = [];
    const received = {A: [], B: []};
    for (let i = 0; i < messages.length; i++) {
        const k = i % 2;
        const rx = rxs[k];
        rx.flow(1); // JMS prefetch 0: one credit per receive()
        const item = await rx.next(`message ${i}`);
        out(describe(item, opts.raw, {receiver: rx.label, index: i}));
        item.delivery.accept();
        received[rx.label].push(toJson(item.message.body));
        // nothing beyond the credit may arrive (checked after a round trip)
        await sync(conns[k]);
        await sync(conns[1 - k]);
        for (const r of rxs) {
            if (r.received > r.granted) {
                problems.push(`receiver ${r.label}: ${r.received} messages for ${r.granted} credit`);
            }
        }
    }
    // receiveNoWait on each: drain 1 credit, nothing left
    for (const rx of rxs) {
        const extra = await rx.drainAll(1);
        if (extra.length) problems.push(`receiver ${rx.label}: extra ${JSON.stringify(bodiesOf(extra))}`);
        extra.forEach((g) => g.delivery.release());
    }
    out({event: 'prefetch0_done', address, outcomes, received, ok: problems.length === 0, problems});
    if (problems.length) throw new CheckFailed(problems.join('; '));
}

// ------------------------------------------------------------- transactions by hand
//
// rhea has no transaction API. What it takes to use one anyway:
//  - the Coordinator target: rhea always writes a `target` terminus, so the attach's
//    target is replaced with a described amqp:coordinator:list before it is written;
//  - Declare / Discharge: amqp-value bodies made with rhea.types.described;
//  - the outcomes declared and transactional-state: rhea does not know them, so
//    message.unwrap_outcome is wrapped to give them an event name;
//  - a transactional send: rhea's transfer frame never carries a state, so the frame
//    is patched (transferStates) for the deliveries that belong to a transaction.

const TXN = {coordinator: 0x30, declare: 0x31, discharge: 0x32, declared: 0x33, state: 0x34};
const transferStates = new Map(); // `${handle}/${delivery_id}` -> transactional-state

function descriptorOf(v) {
    if (!v || !v.descriptor) return undefined;
    const d = v.descriptor.value;
    if (d === 'amqp:declared:list') return TXN.declared;
    if (d === 'amqp:transactional-state:list') return TXN.state;
    return typeof d === 'number' ? d : undefined;
}

let txnPatched = false;
function patchForTransactions() {
    if (txnPatched) return;
    txnPatched = true;
    const frames = require('rhea/lib/frames.js');
    const originalTransfer = frames.transfer;
    frames.transfer = function (fields) {
        const f = originalTransfer(fields);
        const st = transferStates.get(`${fields.handle}/${fields.delivery_id}`);
        if (st !== undefined) {
            for (let i = 0; i < 7; i++) if (f.value[i] === undefined) f.value[i] = rhea.types.Null();
            f.value[7] = st;
        }
        return f;
    };
    class Declared {
        constructor(v) {
            this.txn_id = rhea.types.unwrap(v.value)[0];
        }
    }
    Declared.composite_type = 'declared';
    class TransactionalState {
        constructor(v) {
            const items = v.value.value || v.value;
            this.txn_id = rhea.types.unwrap(items[0]);
            this.outcome = items.length > 1 && items[1] && items[1].descriptor
                ? originalUnwrapOutcome(items[1]) : null;
        }
    }
    TransactionalState.composite_type = 'transactional_state';
    const originalUnwrapOutcome = rhea.message.unwrap_outcome;
    rhea.message.unwrap_outcome = function (outcome) {
        const d = descriptorOf(outcome);
        if (d === TXN.declared) return new Declared(outcome);
        if (d === TXN.state) return new TransactionalState(outcome);
        return originalUnwrapOutcome.call(this, outcome);
    };
    // rhea warns about the coordinator target it cannot decode into a terminus
    const warn = console.warn;
    console.warn = function (...args) {
        if (typeof args[0] === 'string' && args[0].startsWith('Unknown terminus')) return;
        warn.apply(console, args);
    };
}

function outcomeName(state) {
    if (!state) return null;
    if (state.constructor && state.constructor.composite_type) return state.constructor.composite_type;
    return 'unknown';
}

function stateJson(state) {
    if (!state) return {outcome: null};
    const o = {outcome: outcomeName(state)};
    if (state.error) {
        o.condition = toJson(state.error.condition);
        o.description = toJson(state.error.description);
    }
    if (state.txn_id !== undefined) o.txn_id = toJson(state.txn_id);
    if (state.outcome !== undefined) o.inner = state.outcome ? outcomeName(state.outcome) : null;
    return o;
}

function transactionalState(txnId, outcome) {
    const items = [txnId];
    if (outcome) items.push(outcome);
    return rhea.types.described(rhea.types.wrap_ulong(TXN.state), rhea.types.wrap_list(items));
}

// A message of one amqp-value section holding a described value. (rhea.message.encode
// would put the section's descriptor in place of the value's own: rhea.types.described
// sets the descriptor on the value it is given.)
function amqpValueSection(value) {
    const w = new rhea.types.Writer();
    w.write(value);
    return Buffer.concat([Buffer.from([0x00, 0x53, 0x77]), w.toBuffer()]);
}

class Coordinator {
    constructor(c) {
        this.label = 'coordinator';
        this.opened = false;
        this.remoteDetach = null;
        this.waiting = new Map(); // delivery -> settled state
        this.link = c.conn.open_sender({target: {}, autosettle: true, name: `rhea-coordinator-${process.pid}`});
        const T = rhea.types;
        this.link.local.attach.target = T.described(T.wrap_ulong(TXN.coordinator),
            T.wrap_list([T.wrap_array(['amqp:local-transactions'], 0xa3)]));
        const l = this.link;
        l.on('sender_open', () => {
            this.opened = true;
            kick();
        });
        const onDetach = () => {
            this.remoteDetach = {closed: Boolean(l.remote.detach.closed), error: l.error};
            kick();
        };
        l.on('sender_error', onDetach);
        l.on('sender_close', onDetach);
        l.on('sendable', kick);
        l.on('settled', (ctx) => {
            this.waiting.set(ctx.delivery, ctx.delivery.remote_state || null);
            kick();
        });
    }

    async control(body, what) {
        await until(() => this.remoteDetach || this.link.sendable(), `credit for the coordinator (${what})`);
        if (this.remoteDetach) throw new Error(`coordinator detached: ${errorText(this.remoteDetach.error)}`);
        const d = this.link.send(amqpValueSection(body), undefined, 0);
        await until(() => this.waiting.has(d) || this.remoteDetach, `the broker to settle the ${what}`);
        if (!this.waiting.has(d)) throw new Error(`coordinator detached: ${errorText(this.remoteDetach.error)}`);
        return this.waiting.get(d);
    }

    async declare() {
        const T = rhea.types;
        return this.control(T.described(T.wrap_ulong(TXN.declare), T.wrap_list([])), 'declare');
    }

    async discharge(txnId, fail) {
        const T = rhea.types;
        return this.control(T.described(T.wrap_ulong(TXN.discharge),
            T.wrap_list([txnId, Boolean(fail)])), 'discharge');
    }
}

// Sends messages in a transaction; resolves with each delivery's state once the broker
// answered it (settled or not).
async function sendInTxn(tx, messages, txnId) {
    const ds = [];
    for (const m of messages) {
        await until(() => tx.link.sendable(), `credit for sender ${tx.label}`);
        const d = tx.link.send(rhea.message.encode(m), undefined, 0);
        transferStates.set(`${tx.link.local.handle}/${d.id}`, transactionalState(txnId));
        ds.push(d);
    }
    await until(() => ds.every((d) => d.remote_state || d.remote_settled),
        `the broker to answer ${ds.length} transactional transfer(s)`);
    return ds.map((d) => Object.assign(stateJson(d.remote_state), {settled: Boolean(d.remote_settled)}));
}

// Accepts received messages in a transaction (settled, transactional-state {txn-id,
// accepted}), and makes sure the broker has the dispositions before anything else is
// sent: rhea writes a session's pending transfers before its pending dispositions, so
// a Discharge sent right away would overtake them.
async function acceptInTxn(c, items, txnId) {
    for (const g of items) {
        g.delivery.update(true, transactionalState(txnId, rhea.message.accepted().described()));
    }
    await new Promise((resolve) => setImmediate(resolve));
    await sync(c);
}

async function scenarioTxn(opts) {
    patchForTransactions();
    const address = opts.address || 'rhea.txn';
    const c = await connect(opts, 'client');
    const coord = new Coordinator(c);
    const r = await attachOutcome(c, coord);
    out(Object.assign({event: r.refused ? 'refused' : 'attached', receiver: 'coordinator'}, r));
    if (r.refused) throw new CheckFailed(`coordinator link refused: ${r.condition} ${r.description}`);
    const declare = async (label) => {
        const st = await coord.declare();
        out(Object.assign({event: 'declare', txn: label}, stateJson(st)));
        if (outcomeName(st) !== 'declared') throw new CheckFailed(`declare ${label}: ${JSON.stringify(stateJson(st))}`);
        return st.txn_id;
    };
    const discharge = async (label, txnId, fail) => {
        const st = await coord.discharge(txnId, fail);
        out(Object.assign({event: 'discharge', txn: label, fail}, stateJson(st)));
        return outcomeName(st);
    };
    const tx = new Tx(c, {address}, 'tx');
    await tx.open();
    const rx = new Rx(c, {address}, 'rx');
    await rx.open();
    const peek = async (phase, credit) => {
        const got = await rx.drainAll(credit);
        got.forEach((g, i) => out(describe(g, false, {receiver: 'rx', phase, index: i})));
        return got;
    };
    const result = {};
    // 1. send in a transaction, roll back: nothing arrives
    const t1 = await declare('t1');
    result.sent_t1 = await sendInTxn(tx, [{body: 't0'}, {body: 't1'}], t1);
    out({event: 'sent', txn: 't1', states: result.sent_t1});
    result.discharge_t1 = await discharge('t1', t1, true);
    result.after_rollback = bodiesOf(await peek('after_rollback', 5));
    // 2. send in a transaction: invisible before the commit, there after it
    const t2 = await declare('t2');
    result.sent_t2 = await sendInTxn(tx, [{body: 't2'}, {body: 't3'}], t2);
    out({event: 'sent', txn: 't2', states: result.sent_t2});
    result.before_commit = bodiesOf(await peek('before_commit', 5));
    result.discharge_t2 = await discharge('t2', t2, false);
    let got = await peek('after_commit', 5);
    result.after_commit = bodiesOf(got);
    // 3. accept in a transaction and roll back: the messages come back, redelivered
    const t3 = await declare('t3');
    await acceptInTxn(c, got, t3);
    result.discharge_t3 = await discharge('t3', t3, true);
    got = await peek('after_ack_rollback', 5);
    result.after_ack_rollback = bodiesOf(got);
    result.redelivered_counts = got.map((g) => (g.message.delivery_count === undefined ? 0 : g.message.delivery_count));
    // 4. accept in a transaction and commit: consumed
    const t4 = await declare('t4');
    await acceptInTxn(c, got, t4);
    result.discharge_t4 = await discharge('t4', t4, false);
    result.after_ack_commit = bodiesOf(await peek('after_ack_commit', 5));
    // 5. discharging an unknown transaction is rejected
    const st = await coord.discharge(Buffer.from('no-such-txn'), false);
    result.unknown = stateJson(st);
    out(Object.assign({event: 'discharge', txn: 'unknown', fail: false}, result.unknown));
    out(Object.assign({event: 'txn_done', address}, result));
}

async function scenarioEcho(opts) {
    const address = opts.address;
    if (address === undefined) throw new UsageError('echo needs --address');
    const c = await connect(opts, 'client');
    const rx = new Rx(c, {address}, 'rx');
    await rx.open();
    const source = rx.sourceJson();
    out({event: 'attached', receiver: 'rx', sent: address, source});
    if (!source || source.address !== address) {
        throw new CheckFailed(`sent source address ${JSON.stringify(address)}, the broker ` +
            `answered ${JSON.stringify(source && source.address)}`);
    }
}

const SCENARIOS = {
    send: scenarioSend,
    receive: scenarioReceive,
    roundtrip: scenarioRoundtrip,
    groups: scenarioGroups,
    dynamic: scenarioDynamic,
    anonymous: scenarioAnonymous,
    release: scenarioRelease,
    selector: scenarioSelector,
    'no-local': scenarioNoLocal,
    'temp-queue': scenarioTempQueue,
    'temp-topic': scenarioTempTopic,
    'durable-sub': scenarioDurableSub,
    'shared-sub': scenarioSharedSub,
    browse: scenarioBrowse,
    drain: scenarioDrain,
    prefetch0: scenarioPrefetch0,
    txn: scenarioTxn,
    echo: scenarioEcho,
};

// ---------------------------------------------------------------------------- main

async function main() {
    let opts;
    try {
        opts = parseArgs(process.argv.slice(2));
        if (!SCENARIOS[opts.scenario]) throw new UsageError(`unknown scenario ${opts.scenario}`);
        if (opts.port === undefined) throw new UsageError('--port is required');
        if (opts.timeout !== undefined) {
            const t = Number(opts.timeout);
            if (!(t > 0)) throw new UsageError('--timeout must be a number of seconds > 0');
            TIMEOUT_MS = t * 1000;
        }
    } catch (e) {
        process.stderr.write(`rhea_client: ${e.message}\n${USAGE}\n`);
        process.exit(2);
    }
    let code = 0;
    try {
        await SCENARIOS[opts.scenario](opts);
    } catch (e) {
        code = e instanceof CheckFailed ? 1 : e instanceof UsageError ? 2 : 3;
        process.stderr.write(`rhea_client ${opts.scenario}: ${e.message}\n`);
    }
    try {
        await closeAll();
    } catch (e) {
        process.stderr.write(`rhea_client ${opts.scenario}: ${e.message}\n`);
        if (code === 0) code = 3;
    }
    process.exit(code);
}

main();
