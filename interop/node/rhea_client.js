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
//
// Common options
//   --host H (127.0.0.1)  --port P (required)  --timeout SECONDS (10, per wait)
//   --username U --password P   SASL PLAIN (default: no SASL layer at all)
//   --sasl-anonymous            SASL ANONYMOUS
//   --container-id ID
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
//
// Received values are printed as JSON; values JSON cannot show are tagged:
// binary {"$binary": hex}, data section {"$data": hex}, timestamp {"$timestamp": ms}.
'use strict';

const rhea = require('rhea');

const USAGE =
    'usage: node rhea_client.js <send|receive|roundtrip|groups|dynamic|anonymous|release> ' +
    '--port P [--address A] [--count N] [--timeout S] [...] (see the header of this file)';

// --------------------------------------------------------------------- errors, exit

class CheckFailed extends Error {}
class UsageError extends Error {}

function out(obj) {
    process.stdout.write(JSON.stringify(obj) + '\n');
}

// ---------------------------------------------------------------- argument parsing

const FLAGS = new Set(['durable', 'raw', 'expect-empty', 'ready', 'missing-to', 'sasl-anonymous']);
const VALUES = new Set([
    'host', 'port', 'address', 'count', 'timeout', 'username', 'password', 'container-id',
    'body-prefix', 'groups', 'group-prefix', 'messages', 'credit', 'to',
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

async function connect(opts, role) {
    const container = rhea.create_container({
        id: opts['container-id'] || `rhea-interop-${role}-${process.pid}`,
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
    const c = {role, opened: false, closed: false};
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
        fail(new Error(`connection ${role} closed by the broker`));
        kick();
    });
    conn.on('disconnected', (ctx) => {
        c.closed = true;
        fail(new Error(`connection ${role} lost: ${ctx.error ? ctx.error.message : 'socket closed'}`));
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
        sock.once('close', () => {
            c.closed = true;
            kick();
        });
        c.conn.close();
    }
    await until(() => connections.every((c) => c.closed), 'the broker to close the connections');
}

// -------------------------------------------------------------------------- links

function linkError(link, what) {
    return new Error(`${what} closed by the broker: ${errorText(link.error)}`);
}

class Tx {
    constructor(c, target, label) {
        this.label = label;
        this.opened = false;
        this.results = new Map(); // delivery -> {index, outcome, remote_settled, error}
        this.settledCount = 0;
        this.link = c.conn.open_sender({target, autosettle: true, treat_modified_as_released: false});
        const l = this.link;
        l.on('sender_open', () => {
            this.opened = true;
            kick();
        });
        l.on('sender_error', () => fail(linkError(l, `sender ${label}`)));
        l.on('sender_close', () => fail(linkError(l, `sender ${label}`)));
        l.on('sendable', kick);
        for (const outcome of ['accepted', 'rejected', 'released', 'modified']) {
            l.on(outcome, (ctx) => this.record(ctx.delivery, outcome));
        }
        l.on('settled', (ctx) => this.record(ctx.delivery, null));
    }

    record(d, outcome) {
        const r = this.results.get(d);
        if (r === undefined) return;
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
    constructor(c, source, label) {
        this.label = label;
        this.opened = false;
        this.drained = false;
        this.queue = [];
        this.received = 0;
        this.link = c.conn.open_receiver({source, autoaccept: false, credit_window: 0});
        const l = this.link;
        l.on('receiver_open', () => {
            this.opened = true;
            kick();
        });
        l.on('receiver_error', () => fail(linkError(l, `receiver ${label}`)));
        l.on('receiver_close', () => fail(linkError(l, `receiver ${label}`)));
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
        if (n > 0) this.link.flow(n);
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

const SCENARIOS = {
    send: scenarioSend,
    receive: scenarioReceive,
    roundtrip: scenarioRoundtrip,
    groups: scenarioGroups,
    dynamic: scenarioDynamic,
    anonymous: scenarioAnonymous,
    release: scenarioRelease,
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
