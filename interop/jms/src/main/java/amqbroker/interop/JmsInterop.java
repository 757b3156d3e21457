/*
 * amqbroker interoperability checks with the Qpid JMS client (AMQP 1.0, Jakarta Messaging).
 *
 * Usage:
 *   java -cp <classes>:<qpid-jms classpath> amqbroker.interop.JmsInterop \
 *        [--url amqp://127.0.0.1:5672] [--id RUNID] [--user U --password P] SCENARIO...
 *
 * Scenarios: queue groups durable durable-send durable-receive temporary transacted
 *            drain redelivery all
 *
 * Every check prints exactly one JSON object on its own line on stdout:
 *   {"scenario":"queue","check":"text","ok":true, ...observations...}
 * A check that throws prints "ok":false with "error":"<exception class>: <message>".
 * Diagnostics go to stderr. Exit status: 0 every check ok, 1 some check failed, 2 usage.
 *
 * Queue names are "interop.<scenario>.<RUNID>" so runs against a shared broker do not
 * meet; durable-send and durable-receive must be given the same --id.
 */
package amqbroker.interop;

import jakarta.jms.BytesMessage;
import jakarta.jms.Connection;
import jakarta.jms.DeliveryMode;
import jakarta.jms.Destination;
import jakarta.jms.JMSException;
import jakarta.jms.MapMessage;
import jakarta.jms.Message;
import jakarta.jms.MessageConsumer;
import jakarta.jms.MessageProducer;
import jakarta.jms.Queue;
import jakarta.jms.Session;
import jakarta.jms.TemporaryQueue;
import jakarta.jms.TextMessage;

import org.apache.qpid.jms.JmsConnectionFactory;

import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.Enumeration;
import java.util.LinkedHashMap;
import java.util.LinkedHashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.TreeMap;
import java.util.TreeSet;
import java.util.UUID;
import java.util.concurrent.ConcurrentLinkedQueue;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;

public final class JmsInterop {

    /** Qpid JMS: message property selecting the outcome of acknowledge() (JmsMessageSupport). */
    static final String ACK_TYPE = "JMS_AMQP_ACK_TYPE";
    static final int ACK_MODIFIED_FAILED = 4;
    /** Property the broker adds to the first message of a group given to a consumer. */
    static final String GROUP_FIRST = "JMSXGroupFirstForConsumer";
    /** A receive on an empty queue must come back within this many milliseconds. */
    static final long PROMPT_MS = 2000;
    static final long RECEIVE_MS = 5000;

    static final List<String> SCENARIOS = Arrays.asList(
        "queue", "groups", "durable", "temporary", "transacted", "drain", "redelivery");

    private final String url;
    private final String runId;
    private final String user;
    private final String password;
    private boolean allOk = true;

    JmsInterop(String url, String runId, String user, String password) {
        this.url = url;
        this.runId = runId;
        this.user = user;
        this.password = password;
    }

    public static void main(String[] args) {
        String url = "amqp://127.0.0.1:5672";
        String id = UUID.randomUUID().toString().substring(0, 8);
        String user = null;
        String password = null;
        List<String> scenarios = new ArrayList<>();
        for (int i = 0; i < args.length; i++) {
            String a = args[i];
            if (a.equals("--url") && i + 1 < args.length) {
                url = args[++i];
            } else if (a.equals("--id") && i + 1 < args.length) {
                id = args[++i];
            } else if (a.equals("--user") && i + 1 < args.length) {
                user = args[++i];
            } else if (a.equals("--password") && i + 1 < args.length) {
                password = args[++i];
            } else if (a.startsWith("--")) {
                usage("unknown option: " + a);
            } else {
                // scenario names, also several in one argument: "queue,groups" or "queue groups"
                for (String name : a.trim().split("[,\\s]+")) {
                    if (name.equals("all")) {
                        scenarios.addAll(SCENARIOS);
                    } else if (SCENARIOS.contains(name) || name.equals("durable-send")
                            || name.equals("durable-receive")) {
                        scenarios.add(name);
                    } else if (!name.isEmpty()) {
                        usage("unknown scenario: " + name);
                    }
                }
            }
        }
        if (scenarios.isEmpty()) {
            scenarios.addAll(SCENARIOS);
        }
        JmsInterop run = new JmsInterop(url, id, user, password);
        for (String s : scenarios) {
            run.runScenario(s);
        }
        System.out.flush();
        System.exit(run.allOk ? 0 : 1);
    }

    static void usage(String problem) {
        System.err.println(problem);
        System.err.println("usage: JmsInterop [--url amqp://127.0.0.1:5672] [--id RUNID] "
            + "[--user U --password P] {" + String.join("|", SCENARIOS)
            + "|durable-send|durable-receive|all}...");
        System.exit(2);
    }

    void runScenario(String scenario) {
        System.err.println("== scenario " + scenario + " (id " + runId + ")");
        try {
            switch (scenario) {
                case "queue": queue(); break;
                case "groups": groups(); break;
                case "durable": durable(); break;
                case "durable-send": durableSend(); break;
                case "durable-receive": durableReceive(); break;
                case "temporary": temporary(); break;
                case "transacted": transacted(); break;
                case "drain": drain(); break;
                case "redelivery": redelivery(); break;
                default: throw new IllegalArgumentException(scenario);
            }
        } catch (Throwable t) {
            t.printStackTrace();
            Map<String, Object> r = result(scenario, "scenario");
            r.put("error", describe(t));
            emit(r, false);
        }
    }

    // ------------------------------------------------------------------ infrastructure

    String queueName(String scenario) {
        return "interop." + scenario + "." + runId;
    }

    /** A connection with bounded timeouts so that a broker that never answers fails the check. */
    Connection connect(String options) throws JMSException {
        String u = url;
        if (options != null && !options.isEmpty()) {
            u += (u.contains("?") ? "&" : "?") + options;
        }
        JmsConnectionFactory f = new JmsConnectionFactory(u);
        f.setConnectTimeout(10000);
        f.setRequestTimeout(10000);
        f.setSendTimeout(10000);
        f.setCloseTimeout(5000);
        Connection c = user == null ? f.createConnection() : f.createConnection(user, password);
        c.start();
        return c;
    }

    Connection connect() throws JMSException {
        return connect(null);
    }

    static void closeQuietly(Connection c) {
        if (c != null) {
            try {
                c.close();
            } catch (Throwable t) {
                System.err.println("close failed: " + describe(t));
            }
        }
    }

    static Map<String, Object> result(String scenario, String check) {
        Map<String, Object> r = new LinkedHashMap<>();
        r.put("scenario", scenario);
        r.put("check", check);
        return r;
    }

    void emit(Map<String, Object> r, boolean ok) {
        Map<String, Object> out = new LinkedHashMap<>();
        out.put("scenario", r.remove("scenario"));
        out.put("check", r.remove("check"));
        out.put("ok", ok);
        out.putAll(r);
        allOk &= ok;
        System.out.println(Json.write(out));
        System.out.flush();
    }

    /** Runs one check; an exception becomes "ok":false with "error". */
    interface Check {
        boolean run(Map<String, Object> r) throws Exception;
    }

    void check(String scenario, String check, Check body) {
        Map<String, Object> r = result(scenario, check);
        boolean ok;
        try {
            ok = body.run(r);
        } catch (Throwable t) {
            t.printStackTrace();
            r.put("error", describe(t));
            ok = false;
        }
        emit(r, ok);
    }

    static String describe(Throwable t) {
        StringBuilder sb = new StringBuilder(t.getClass().getName() + ": " + t.getMessage());
        Throwable cause = t.getCause();
        if (t instanceof JMSException && ((JMSException) t).getLinkedException() != null
                && cause == null) {
            cause = ((JMSException) t).getLinkedException();
        }
        int depth = 0;
        while (cause != null && cause != t && depth++ < 3) {
            sb.append(" | caused by ").append(cause.getClass().getName()).append(": ")
                .append(cause.getMessage());
            cause = cause.getCause();
        }
        return sb.toString();
    }

    static Object propertyValue(Message m, String name) throws JMSException {
        return m.propertyExists(name) ? m.getObjectProperty(name) : null;
    }

    static String body(Message m) throws JMSException {
        if (m == null) {
            return null;
        }
        if (m instanceof TextMessage) {
            return ((TextMessage) m).getText();
        }
        return "<" + m.getClass().getSimpleName() + ">";
    }

    static Map<String, Object> userProperties(Message m) throws JMSException {
        Map<String, Object> props = new TreeMap<>();
        Enumeration<?> names = m.getPropertyNames();
        while (names.hasMoreElements()) {
            String n = (String) names.nextElement();
            if (!n.startsWith("JMSX") && !n.startsWith("JMS_")) {
                Object v = m.getObjectProperty(n);
                props.put(n, typed(v));
            }
        }
        return props;
    }

    /** A property value with its Java type, e.g. "Integer:7", so types are compared exactly. */
    static String typed(Object v) {
        return v == null ? "null" : v.getClass().getSimpleName() + ":" + v;
    }

    // ------------------------------------------------------------------ queue

    void queue() {
        String q = queueName("queue");
        check("queue", "text", r -> {
            Connection c = connect();
            try {
                Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                Queue dest = s.createQueue(q);
                MessageProducer p = s.createProducer(dest);
                int n = 5;
                for (int i = 0; i < n; i++) {
                    TextMessage m = s.createTextMessage("text-" + i);
                    m.setStringProperty("s", "str-" + i);
                    m.setIntProperty("i", i);
                    m.setLongProperty("l", 10000000000L + i);
                    m.setBooleanProperty("b", i % 2 == 0);
                    m.setDoubleProperty("d", i + 0.5);
                    m.setShortProperty("sh", (short) i);
                    m.setByteProperty("by", (byte) i);
                    m.setFloatProperty("f", 1.25f);
                    m.setJMSCorrelationID("corr-" + i);
                    m.setJMSType("type-" + i);
                    p.send(m);
                }
                MessageConsumer consumer = s.createConsumer(dest);
                List<String> bodies = new ArrayList<>();
                List<Map<String, Object>> props = new ArrayList<>();
                List<String> headers = new ArrayList<>();
                boolean allHaveIds = true;
                for (int i = 0; i < n; i++) {
                    Message m = consumer.receive(RECEIVE_MS);
                    if (m == null) {
                        break;
                    }
                    bodies.add(body(m));
                    props.add(userProperties(m));
                    allHaveIds &= m.getJMSMessageID() != null && m.getJMSMessageID().startsWith("ID:");
                    headers.add(m.getJMSCorrelationID() + "|" + m.getJMSType() + "|"
                        + ((Queue) m.getJMSDestination()).getQueueName() + "|"
                        + m.getJMSDeliveryMode() + "|" + m.getJMSRedelivered() + "|"
                        + m.getIntProperty("JMSXDeliveryCount"));
                }
                Message extra = consumer.receive(300);
                r.put("queue", q);
                r.put("bodies", bodies);
                r.put("properties", props);
                r.put("headers", headers);
                r.put("messageIds", allHaveIds);
                r.put("extra", body(extra));
                List<String> expected = new ArrayList<>();
                for (int i = 0; i < n; i++) {
                    expected.add("text-" + i);
                }
                boolean ok = bodies.equals(expected) && allHaveIds && extra == null;
                for (int i = 0; ok && i < n; i++) {
                    Map<String, Object> want = new TreeMap<>();
                    want.put("b", typed(i % 2 == 0));
                    want.put("by", typed((byte) i));
                    want.put("d", typed(i + 0.5));
                    want.put("f", typed(1.25f));
                    want.put("i", typed(i));
                    want.put("l", typed(10000000000L + i));
                    want.put("s", typed("str-" + i));
                    want.put("sh", typed((short) i));
                    ok = want.equals(props.get(i)) && headers.get(i).equals(
                        "corr-" + i + "|type-" + i + "|" + q + "|" + DeliveryMode.PERSISTENT
                        + "|false|1");
                }
                return ok;
            } finally {
                closeQuietly(c);
            }
        });
        check("queue", "types", r -> {
            Connection c = connect();
            try {
                Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                Queue dest = s.createQueue(q + ".types");
                MessageProducer p = s.createProducer(dest);
                BytesMessage bm = s.createBytesMessage();
                bm.writeBytes(new byte[] {1, 2, 3});
                p.send(bm);
                MapMessage mm = s.createMapMessage();
                mm.setString("k", "v");
                mm.setInt("n", 42);
                p.send(mm);
                p.send(s.createMessage());
                MessageConsumer consumer = s.createConsumer(dest);
                List<String> got = new ArrayList<>();
                for (int i = 0; i < 3; i++) {
                    Message m = consumer.receive(RECEIVE_MS);
                    if (m == null) {
                        break;
                    }
                    if (m instanceof BytesMessage) {
                        BytesMessage b = (BytesMessage) m;
                        byte[] buf = new byte[(int) b.getBodyLength()];
                        b.readBytes(buf);
                        got.add("bytes:" + Arrays.toString(buf));
                    } else if (m instanceof MapMessage) {
                        MapMessage x = (MapMessage) m;
                        got.add("map:" + x.getString("k") + "," + x.getInt("n"));
                    } else {
                        got.add("message:" + m.getClass().getSimpleName());
                    }
                }
                r.put("received", got);
                return got.equals(Arrays.asList("bytes:[1, 2, 3]", "map:v,42", "message:JmsMessage"));
            } finally {
                closeQuietly(c);
            }
        });
    }

    // ------------------------------------------------------------------ groups

    static final class Got {
        final int consumer;
        final int arrival;
        final String group;
        final int seq;
        final String body;
        final Object first;

        Got(int consumer, int arrival, String group, int seq, String body, Object first) {
            this.consumer = consumer;
            this.arrival = arrival;
            this.group = group;
            this.seq = seq;
            this.body = body;
            this.first = first;
        }
    }

    void groups() throws Exception {
        final String q = queueName("groups");
        final int consumers = 3;
        final int groups = 6;
        final int round1 = 5; // seq 1..4, then -1 closes the group
        final int round2 = 3; // seq 1..3 after the close: the group is bound afresh
        final int total = groups * (round1 + round2);
        final ConcurrentLinkedQueue<Got> got = new ConcurrentLinkedQueue<>();
        final CountDownLatch done = new CountDownLatch(total);
        final AtomicInteger arrivals = new AtomicInteger();
        final ConcurrentLinkedQueue<String> listenerErrors = new ConcurrentLinkedQueue<>();
        List<Connection> conns = new ArrayList<>();
        boolean received;
        try {
            for (int i = 0; i < consumers; i++) {
                final int idx = i;
                Connection c = connect();
                conns.add(c);
                Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                MessageConsumer mc = s.createConsumer(s.createQueue(q));
                mc.setMessageListener(m -> {
                    try {
                        got.add(new Got(idx, arrivals.getAndIncrement(),
                            m.getStringProperty("JMSXGroupID"), m.getIntProperty("JMSXGroupSeq"),
                            body(m), propertyValue(m, GROUP_FIRST)));
                    } catch (Throwable t) {
                        listenerErrors.add(describe(t));
                    } finally {
                        done.countDown();
                    }
                });
            }
            Thread.sleep(300); // let every consumer's credit reach the broker
            Connection pc = connect();
            conns.add(pc);
            Session ps = pc.createSession(false, Session.AUTO_ACKNOWLEDGE);
            MessageProducer p = ps.createProducer(ps.createQueue(q));
            for (int seq = 1; seq <= round1; seq++) {
                for (int g = 0; g < groups; g++) {
                    TextMessage m = ps.createTextMessage("g" + g + "-r1-" + seq);
                    m.setStringProperty("JMSXGroupID", "grp-" + g);
                    m.setIntProperty("JMSXGroupSeq", seq < round1 ? seq : -1);
                    p.send(m);
                }
            }
            for (int seq = 1; seq <= round2; seq++) {
                for (int g = 0; g < groups; g++) {
                    TextMessage m = ps.createTextMessage("g" + g + "-r2-" + seq);
                    m.setStringProperty("JMSXGroupID", "grp-" + g);
                    m.setIntProperty("JMSXGroupSeq", seq);
                    p.send(m);
                }
            }
            received = done.await(15, TimeUnit.SECONDS);
            Thread.sleep(200); // anything extra (duplicates) would show up now
        } finally {
            for (Connection c : conns) {
                closeQuietly(c);
            }
        }

        List<Got> all = new ArrayList<>(got);
        all.sort((a, b) -> Integer.compare(a.arrival, b.arrival));
        // key "grp-N/rR" -> messages in arrival order (per consumer order is arrival order)
        Map<String, List<Got>> byGroup = new TreeMap<>();
        for (Got x : all) {
            String round = x.body != null && x.body.contains("-r2-") ? "r2" : "r1";
            byGroup.computeIfAbsent(x.group + "/" + round, k -> new ArrayList<>()).add(x);
        }
        Map<String, Object> owners = new TreeMap<>();
        List<String> split = new ArrayList<>();
        List<String> misordered = new ArrayList<>();
        Map<String, Object> firstFlags = new TreeMap<>();
        Set<String> flagValues = new LinkedHashSet<>();
        int[] round1GroupsPerConsumer = new int[consumers];
        boolean firstOk = true;
        boolean anyFirst = false;
        for (Map.Entry<String, List<Got>> e : byGroup.entrySet()) {
            List<Got> msgs = e.getValue();
            Set<Integer> who = new LinkedHashSet<>();
            List<String> bodies = new ArrayList<>();
            List<Integer> flagged = new ArrayList<>();
            for (int i = 0; i < msgs.size(); i++) {
                Got x = msgs.get(i);
                who.add(x.consumer);
                bodies.add(x.body);
                if (x.first != null) {
                    anyFirst = true;
                    flagValues.add(typed(x.first));
                    if (Boolean.TRUE.equals(x.first)) {
                        flagged.add(i);
                    }
                }
            }
            owners.put(e.getKey(), new ArrayList<>(who));
            if (who.size() != 1) {
                split.add(e.getKey());
            }
            boolean r2 = e.getKey().endsWith("/r2");
            int n = r2 ? round2 : round1;
            String g = e.getKey().substring(4, e.getKey().indexOf('/'));
            List<String> want = new ArrayList<>();
            for (int seq = 1; seq <= n; seq++) {
                want.add("g" + g + (r2 ? "-r2-" : "-r1-") + seq);
            }
            if (!bodies.equals(want)) {
                misordered.add(e.getKey() + "=" + bodies);
            }
            firstFlags.put(e.getKey(), flagged);
            firstOk &= flagged.equals(Collections.singletonList(0));
            if (!r2 && who.size() == 1) {
                round1GroupsPerConsumer[who.iterator().next()]++;
            }
        }
        Set<Integer> closeSeqs = new TreeSet<>();
        Set<String> groupIds = new TreeSet<>();
        for (Got x : all) {
            groupIds.add(x.group);
            if (x.body != null && x.body.endsWith("-r1-" + round1)) {
                closeSeqs.add(x.seq);
            }
        }
        int[] sortedCounts = round1GroupsPerConsumer.clone();
        Arrays.sort(sortedCounts);
        List<Integer> counts = new ArrayList<>();
        for (int v : sortedCounts) {
            counts.add(v);
        }

        Map<String, Object> r = result("groups", "assignment");
        r.put("expected", total);
        r.put("received", all.size());
        r.put("complete", received);
        r.put("split", split);
        r.put("misordered", misordered);
        r.put("round1GroupsPerConsumer", counts);
        r.put("owners", owners);
        r.put("listenerErrors", new ArrayList<>(listenerErrors));
        emit(r, received && all.size() == total && split.isEmpty() && misordered.isEmpty()
            && listenerErrors.isEmpty() && byGroup.size() == 2 * groups);

        r = result("groups", "fields");
        r.put("groupIds", new ArrayList<>(groupIds));
        r.put("closeSeqs", new ArrayList<>(closeSeqs));
        List<String> wantIds = new ArrayList<>();
        for (int g = 0; g < groups; g++) {
            wantIds.add("grp-" + g);
        }
        emit(r, new ArrayList<>(groupIds).equals(wantIds)
            && new ArrayList<>(closeSeqs).equals(Collections.singletonList(-1)));

        r = result("groups", "firstForConsumer");
        r.put("present", anyFirst);
        r.put("values", new ArrayList<>(flagValues));
        r.put("flaggedPositions", firstFlags);
        emit(r, anyFirst && firstOk);
    }

    // ------------------------------------------------------------------ durable

    void durable() {
        String q = queueName("durable");
        check("durable", "deliveryMode", r -> {
            Connection c = connect();
            try {
                Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                Queue dest = s.createQueue(q);
                MessageProducer p = s.createProducer(dest);
                p.setDeliveryMode(DeliveryMode.PERSISTENT);
                for (int i = 0; i < 3; i++) {
                    p.send(s.createTextMessage("persistent-" + i));
                }
                p.send(s.createTextMessage("non-persistent"), DeliveryMode.NON_PERSISTENT,
                    Message.DEFAULT_PRIORITY, Message.DEFAULT_TIME_TO_LIVE);
                MessageConsumer mc = s.createConsumer(dest);
                List<String> got = new ArrayList<>();
                for (int i = 0; i < 4; i++) {
                    Message m = mc.receive(RECEIVE_MS);
                    if (m == null) {
                        break;
                    }
                    got.add(body(m) + "|" + m.getJMSDeliveryMode());
                }
                r.put("received", got);
                return got.equals(Arrays.asList("persistent-0|2", "persistent-1|2",
                    "persistent-2|2", "non-persistent|1"));
            } finally {
                closeQuietly(c);
            }
        });
    }

    /** Phase 1 of the restart check: leaves 3 persistent and 1 non-persistent message queued. */
    void durableSend() {
        String q = queueName("durable-restart");
        check("durable-send", "sent", r -> {
            Connection c = connect();
            try {
                Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                MessageProducer p = s.createProducer(s.createQueue(q));
                for (int i = 0; i < 3; i++) {
                    TextMessage m = s.createTextMessage("persistent-" + i);
                    m.setStringProperty("phase", "before-restart");
                    m.setIntProperty("n", i);
                    p.send(m, DeliveryMode.PERSISTENT, 7, Message.DEFAULT_TIME_TO_LIVE);
                }
                p.send(s.createTextMessage("non-persistent"), DeliveryMode.NON_PERSISTENT,
                    Message.DEFAULT_PRIORITY, Message.DEFAULT_TIME_TO_LIVE);
                r.put("queue", q);
                r.put("sent", 4);
                return true;
            } finally {
                closeQuietly(c);
            }
        });
    }

    /** Phase 2, after a broker restart: only the persistent messages are still there. */
    void durableReceive() {
        String q = queueName("durable-restart");
        check("durable-receive", "afterRestart", r -> {
            Connection c = connect();
            try {
                Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                MessageConsumer mc = s.createConsumer(s.createQueue(q));
                List<String> got = new ArrayList<>();
                for (int i = 0; i < 4; i++) {
                    Message m = mc.receive(i < 3 ? RECEIVE_MS : 500);
                    if (m == null) {
                        break;
                    }
                    got.add(body(m) + "|" + m.getJMSDeliveryMode() + "|" + m.getJMSPriority() + "|"
                        + m.getStringProperty("phase") + "|" + propertyValue(m, "n"));
                }
                r.put("received", got);
                return got.equals(Arrays.asList("persistent-0|2|7|before-restart|0",
                    "persistent-1|2|7|before-restart|1", "persistent-2|2|7|before-restart|2"));
            } finally {
                closeQuietly(c);
            }
        });
    }

    // ------------------------------------------------------------------ temporary

    void temporary() {
        String q = queueName("temporary");
        check("temporary", "requestReply", r -> {
            Connection requester = connect();
            Connection responder = connect();
            try {
                Session rs = requester.createSession(false, Session.AUTO_ACKNOWLEDGE);
                TemporaryQueue tq = rs.createTemporaryQueue();
                MessageConsumer replies = rs.createConsumer(tq);
                TextMessage req = rs.createTextMessage("request");
                req.setJMSReplyTo(tq);
                rs.createProducer(rs.createQueue(q)).send(req);

                Session ss = responder.createSession(false, Session.AUTO_ACKNOWLEDGE);
                Message got = ss.createConsumer(ss.createQueue(q)).receive(RECEIVE_MS);
                r.put("temporaryQueue", tq.getQueueName());
                r.put("request", body(got));
                if (got == null) {
                    return false;
                }
                Destination replyTo = got.getJMSReplyTo();
                r.put("replyToIsTemporaryQueue", replyTo instanceof TemporaryQueue);
                r.put("replyToName", replyTo instanceof Queue ? ((Queue) replyTo).getQueueName() : null);
                TextMessage reply = ss.createTextMessage("reply");
                reply.setJMSCorrelationID(got.getJMSMessageID());
                ss.createProducer(replyTo).send(reply);

                Message answer = replies.receive(RECEIVE_MS);
                r.put("reply", body(answer));
                boolean corr = answer != null && req.getJMSMessageID().equals(answer.getJMSCorrelationID());
                r.put("correlationMatches", corr);
                replies.close();
                tq.delete();
                r.put("deleted", true);
                return "reply".equals(body(answer)) && corr && replyTo instanceof TemporaryQueue
                    && tq.getQueueName().equals(((Queue) replyTo).getQueueName());
            } finally {
                closeQuietly(responder);
                closeQuietly(requester);
            }
        });
    }

    // ------------------------------------------------------------------ transacted

    void transacted() {
        String q = queueName("transacted");
        check("transacted", "refused", r -> {
            Connection c = connect();
            try {
                String stage = "createSession";
                Throwable error = null;
                try {
                    Session ts = c.createSession(true, Session.SESSION_TRANSACTED);
                    stage = "send";
                    ts.createProducer(ts.createQueue(q)).send(ts.createTextMessage("in-tx"));
                    stage = "commit";
                    ts.commit();
                } catch (Throwable t) {
                    error = t;
                }
                r.put("failedAt", error == null ? "none" : stage);
                r.put("exception", error == null ? null : error.getClass().getName());
                r.put("message", error == null ? null : error.getMessage());
                r.put("detail", error == null ? null : describe(error));
                // The connection must still work without a transaction.
                Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                Queue dest = s.createQueue(q);
                s.createProducer(dest).send(s.createTextMessage("plain"));
                Message m = s.createConsumer(dest).receive(RECEIVE_MS);
                r.put("afterwards", body(m));
                return error instanceof JMSException && "plain".equals(body(m));
            } finally {
                closeQuietly(c);
            }
        });
    }

    // ------------------------------------------------------------------ drain

    void drain() {
        String q = queueName("drain");
        for (final String prefetch : new String[] {"default", "0"}) {
            check("drain", "prefetch-" + prefetch, r -> {
                // A broker that never completes a drain would make the client wait the drain
                // timeout (60 s by default); 10 s keeps the failure visible but short.
                String opts = "amqp.drainTimeout=10000"
                    + (prefetch.equals("0") ? "&jms.prefetchPolicy.all=0" : "");
                Connection c = connect(opts);
                try {
                    Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                    Queue dest = s.createQueue(q + "." + prefetch);
                    MessageConsumer mc = s.createConsumer(dest);
                    long t0 = System.nanoTime();
                    Message a = mc.receiveNoWait();
                    long t1 = System.nanoTime();
                    Message b = mc.receive(200);
                    long t2 = System.nanoTime();
                    Message c2 = mc.receiveNoWait();
                    long t3 = System.nanoTime();
                    long noWaitMs = (t1 - t0) / 1000000;
                    long timedMs = (t2 - t1) / 1000000;
                    long noWait2Ms = (t3 - t2) / 1000000;
                    r.put("emptyResults", Arrays.asList(body(a), body(b), body(c2)));
                    r.put("prompt", noWaitMs < PROMPT_MS && timedMs < PROMPT_MS && noWait2Ms < PROMPT_MS);
                    r.put("millis", Arrays.asList(noWaitMs, timedMs, noWait2Ms));
                    // After the drains, credit must flow again: a new message is received.
                    s.createProducer(dest).send(s.createTextMessage("after-drain"));
                    Message d = mc.receive(RECEIVE_MS);
                    r.put("afterDrain", body(d));
                    Message e = mc.receiveNoWait();
                    r.put("extra", body(e));
                    return a == null && b == null && c2 == null && (Boolean) r.get("prompt")
                        && "after-drain".equals(body(d)) && e == null;
                } finally {
                    closeQuietly(c);
                }
            });
        }
    }

    // ------------------------------------------------------------------ redelivery

    void redelivery() {
        String q = queueName("redelivery");
        check("redelivery", "recover", r -> {
            Connection c = connect();
            try {
                Session s = c.createSession(false, Session.CLIENT_ACKNOWLEDGE);
                Queue dest = s.createQueue(q + ".recover");
                MessageProducer p = s.createProducer(dest);
                p.send(s.createTextMessage("m1"));
                p.send(s.createTextMessage("m2"));
                MessageConsumer mc = s.createConsumer(dest);
                List<String> first = new ArrayList<>();
                for (int i = 0; i < 2; i++) {
                    Message m = mc.receive(RECEIVE_MS);
                    first.add(m == null ? null : body(m) + "|" + m.getJMSRedelivered() + "|"
                        + m.getIntProperty("JMSXDeliveryCount"));
                }
                s.recover();
                List<String> again = new ArrayList<>();
                Message last = null;
                for (int i = 0; i < 2; i++) {
                    Message m = mc.receive(RECEIVE_MS);
                    again.add(m == null ? null : body(m) + "|" + m.getJMSRedelivered() + "|"
                        + m.getIntProperty("JMSXDeliveryCount"));
                    last = m != null ? m : last;
                }
                if (last != null) {
                    last.acknowledge();
                }
                mc.close();
                // Acknowledged: a new consumer finds nothing.
                Message left = s.createConsumer(dest).receive(500);
                r.put("first", first);
                r.put("afterRecover", again);
                r.put("leftAfterAck", body(left));
                return first.equals(Arrays.asList("m1|false|1", "m2|false|1"))
                    && again.equals(Arrays.asList("m1|true|2", "m2|true|2")) && left == null;
            } finally {
                closeQuietly(c);
            }
        });
        check("redelivery", "modifiedFailed", r -> {
            Connection c = connect();
            try {
                Session s = c.createSession(false, Session.CLIENT_ACKNOWLEDGE);
                Queue dest = s.createQueue(q + ".modified");
                s.createProducer(dest).send(s.createTextMessage("m3"));
                MessageConsumer mc = s.createConsumer(dest);
                Message m = mc.receive(RECEIVE_MS);
                List<String> got = new ArrayList<>();
                got.add(m == null ? null : body(m) + "|" + m.getJMSRedelivered() + "|"
                    + m.getIntProperty("JMSXDeliveryCount"));
                if (m != null) {
                    // Qpid JMS: acknowledge() settles this message as modified(delivery-failed)
                    m.setIntProperty(ACK_TYPE, ACK_MODIFIED_FAILED);
                    m.acknowledge();
                }
                Message again = mc.receive(RECEIVE_MS);
                got.add(again == null ? null : body(again) + "|" + again.getJMSRedelivered() + "|"
                    + again.getIntProperty("JMSXDeliveryCount"));
                if (again != null) {
                    again.acknowledge();
                }
                r.put("received", got);
                return got.equals(Arrays.asList("m3|false|1", "m3|true|2"));
            } finally {
                closeQuietly(c);
            }
        });
        check("redelivery", "closeWithoutAck", r -> {
            String name = q + ".close";
            Connection c1 = connect();
            String firstSeen;
            try {
                Session s = c1.createSession(false, Session.CLIENT_ACKNOWLEDGE);
                Queue dest = s.createQueue(name);
                s.createProducer(dest).send(s.createTextMessage("m4"));
                Message m = s.createConsumer(dest).receive(RECEIVE_MS);
                firstSeen = m == null ? null : body(m) + "|" + m.getJMSRedelivered() + "|"
                    + m.getIntProperty("JMSXDeliveryCount");
            } finally {
                closeQuietly(c1); // unacknowledged: the broker must give it to the next consumer
            }
            Connection c2 = connect();
            try {
                Session s = c2.createSession(false, Session.AUTO_ACKNOWLEDGE);
                Message m = s.createConsumer(s.createQueue(name)).receive(RECEIVE_MS);
                String again = m == null ? null : body(m) + "|" + m.getJMSRedelivered() + "|"
                    + m.getIntProperty("JMSXDeliveryCount");
                r.put("received", Arrays.asList(firstSeen, again));
                return "m4|false|1".equals(firstSeen) && "m4|true|2".equals(again);
            } finally {
                closeQuietly(c2);
            }
        });
        prefetchedOnClose();
    }

    /**
     * Messages that were only prefetched (never handed to the application) by a consumer
     * whose connection closes cleanly are not redeliveries: the next consumer gets them with
     * JMSRedelivered=false and JMSXDeliveryCount=1, and such closes must not use up
     * max-delivery-attempts.
     */
    void prefetchedOnClose() {
        String name = queueName("redelivery") + ".prefetched";
        check("redelivery", "prefetchedOnClose", r -> {
            Connection c1 = connect();
            String firstSeen;
            try {
                Session s = c1.createSession(false, Session.AUTO_ACKNOWLEDGE);
                Queue dest = s.createQueue(name);
                MessageProducer p = s.createProducer(dest);
                for (int i = 0; i < 5; i++) {
                    p.send(s.createTextMessage("p" + i));
                }
                MessageConsumer mc = s.createConsumer(dest);
                Message m = mc.receive(RECEIVE_MS);
                firstSeen = m == null ? null : body(m) + "|" + m.getJMSRedelivered() + "|"
                    + m.getIntProperty("JMSXDeliveryCount");
                Thread.sleep(300); // the other four now sit in the client's prefetch buffer
            } finally {
                closeQuietly(c1);
            }
            Connection c2 = connect();
            try {
                Session s = c2.createSession(false, Session.AUTO_ACKNOWLEDGE);
                MessageConsumer mc = s.createConsumer(s.createQueue(name));
                List<String> got = new ArrayList<>();
                got.add(firstSeen);
                for (int i = 0; i < 4; i++) {
                    Message m = mc.receive(RECEIVE_MS);
                    if (m == null) {
                        break;
                    }
                    got.add(body(m) + "|" + m.getJMSRedelivered() + "|"
                        + m.getIntProperty("JMSXDeliveryCount"));
                }
                r.put("received", got);
                return got.equals(Arrays.asList("p0|false|1", "p1|false|1", "p2|false|1",
                    "p3|false|1", "p4|false|1"));
            } finally {
                closeQuietly(c2);
            }
        });
    }

    // ------------------------------------------------------------------ JSON

    /** Minimal JSON writer: maps, lists, strings, numbers, booleans, null. */
    static final class Json {
        static String write(Object o) {
            StringBuilder sb = new StringBuilder();
            write(sb, o);
            return sb.toString();
        }

        static void write(StringBuilder sb, Object o) {
            if (o == null) {
                sb.append("null");
            } else if (o instanceof String) {
                string(sb, (String) o);
            } else if (o instanceof Boolean || o instanceof Integer || o instanceof Long
                    || o instanceof Short || o instanceof Byte) {
                sb.append(o);
            } else if (o instanceof Number) {
                double d = ((Number) o).doubleValue();
                if (Double.isNaN(d) || Double.isInfinite(d)) {
                    string(sb, String.valueOf(d));
                } else {
                    sb.append(o);
                }
            } else if (o instanceof Map) {
                sb.append('{');
                boolean first = true;
                for (Map.Entry<?, ?> e : ((Map<?, ?>) o).entrySet()) {
                    if (!first) {
                        sb.append(',');
                    }
                    first = false;
                    string(sb, String.valueOf(e.getKey()));
                    sb.append(':');
                    write(sb, e.getValue());
                }
                sb.append('}');
            } else if (o instanceof Iterable) {
                sb.append('[');
                boolean first = true;
                for (Object x : (Iterable<?>) o) {
                    if (!first) {
                        sb.append(',');
                    }
                    first = false;
                    write(sb, x);
                }
                sb.append(']');
            } else {
                string(sb, String.valueOf(o));
            }
        }

        static void string(StringBuilder sb, String s) {
            sb.append('"');
            for (int i = 0; i < s.length(); i++) {
                char ch = s.charAt(i);
                switch (ch) {
                    case '"': sb.append("\\\""); break;
                    case '\\': sb.append("\\\\"); break;
                    case '\n': sb.append("\\n"); break;
                    case '\r': sb.append("\\r"); break;
                    case '\t': sb.append("\\t"); break;
                    default:
                        if (ch < 0x20) {
                            sb.append(String.format("\\u%04x", (int) ch));
                        } else {
                            sb.append(ch);
                        }
                }
            }
            sb.append('"');
        }
    }
}
