/*
 * amqbroker interoperability checks with the Qpid JMS client (AMQP 1.0, Jakarta Messaging).
 *
 * Usage:
 *   java -cp <classes>:<qpid-jms classpath> amqbroker.interop.JmsInterop \
 *        [--url amqp://127.0.0.1:5672] [--id RUNID] [--user U --password P] SCENARIO...
 *
 * Scenarios: queue groups durable temporary transacted drain redelivery clientid selectors
 *            topics durable-subs shared-subs browser delay message-types group-selectors all
 *            and the restart halves durable-send durable-receive durable-sub-send
 *            durable-sub-receive (not part of "all")
 *
 * Every check prints exactly one JSON object on its own line on stdout:
 *   {"scenario":"queue","check":"text","ok":true, ...observations...}
 * A check that throws prints "ok":false with "error":"<exception class>: <message>".
 * Diagnostics go to stderr. Exit status: 0 every check ok, 1 some check failed, 2 usage.
 *
 * Queue names are "interop.<scenario>.<RUNID>" so runs against a shared broker do not
 * meet; the two halves of a restart check (durable-send / durable-receive,
 * durable-sub-send / durable-sub-receive) must be given the same --id.
 */
package amqbroker.interop;

import jakarta.jms.BytesMessage;
import jakarta.jms.Connection;
import jakarta.jms.DeliveryMode;
import jakarta.jms.Destination;
import jakarta.jms.InvalidClientIDException;
import jakarta.jms.InvalidDestinationException;
import jakarta.jms.InvalidSelectorException;
import jakarta.jms.JMSException;
import jakarta.jms.MapMessage;
import jakarta.jms.Message;
import jakarta.jms.MessageConsumer;
import jakarta.jms.MessageEOFException;
import jakarta.jms.MessageProducer;
import jakarta.jms.ObjectMessage;
import jakarta.jms.Queue;
import jakarta.jms.QueueBrowser;
import jakarta.jms.Session;
import jakarta.jms.StreamMessage;
import jakarta.jms.TemporaryQueue;
import jakarta.jms.TemporaryTopic;
import jakarta.jms.TextMessage;
import jakarta.jms.Topic;

import org.apache.qpid.jms.JmsConnectionFactory;

import java.io.Serializable;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.Enumeration;
import java.util.LinkedHashMap;
import java.util.LinkedHashSet;
import java.util.List;
import java.util.Map;
import java.util.Objects;
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

    /** Nothing more may arrive within this many milliseconds after the expected messages. */
    static final long QUIET_MS = 500;
    /** The delivery delay of the delay scenario. */
    static final long DELAY_MS = 2000;

    static final List<String> SCENARIOS = Arrays.asList(
        "queue", "groups", "durable", "temporary", "transacted", "drain", "redelivery",
        "clientid", "selectors", "topics", "durable-subs", "shared-subs", "browser", "delay",
        "message-types", "group-selectors");
    /** The halves of the restart checks: run only when named, never by "all". */
    static final List<String> RESTART_HALVES = Arrays.asList(
        "durable-send", "durable-receive", "durable-sub-send", "durable-sub-receive");

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
                    } else if (SCENARIOS.contains(name) || RESTART_HALVES.contains(name)) {
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
            + "|" + String.join("|", RESTART_HALVES) + "|all}...");
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
                case "clientid": clientId(); break;
                case "selectors": selectors(); break;
                case "topics": topics(); break;
                case "durable-subs": durableSubs(); break;
                case "durable-sub-send": durableSubSend(); break;
                case "durable-sub-receive": durableSubReceive(); break;
                case "shared-subs": sharedSubs(); break;
                case "browser": browser(); break;
                case "delay": delay(); break;
                case "message-types": messageTypes(); break;
                case "group-selectors": groupSelectors(); break;
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

    /**
     * A connection with an explicit JMS clientID (the AMQP container-id), set before anything
     * else is done with the connection, as JMS requires.
     */
    Connection connectAs(String clientId, String options) throws JMSException {
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
        try {
            c.setClientID(clientId);
            c.start();
        } catch (JMSException | RuntimeException e) {
            closeQuietly(c);
            throw e;
        }
        return c;
    }

    Connection connectAs(String clientId) throws JMSException {
        return connectAs(clientId, null);
    }

    /** body|JMSRedelivered|JMSXDeliveryCount */
    static String line(Message m) throws JMSException {
        return m == null ? null : body(m) + "|" + m.getJMSRedelivered() + "|"
            + m.getIntProperty("JMSXDeliveryCount");
    }

    /**
     * The bodies of up to n messages (each within RECEIVE_MS, stopping at the first miss), then
     * of anything else arriving within QUIET_MS, prefixed "extra:". n=0: "nothing arrives".
     */
    static List<String> receiveN(MessageConsumer mc, int n) throws JMSException {
        List<String> got = new ArrayList<>();
        for (int i = 0; i < n; i++) {
            Message m = mc.receive(RECEIVE_MS);
            if (m == null) {
                return got;
            }
            got.add(body(m));
        }
        Message extra = mc.receive(QUIET_MS);
        while (extra != null) {
            got.add("extra:" + body(extra));
            extra = mc.receive(QUIET_MS);
        }
        return got;
    }

    /** Sends "ping" to queue q over c and receives it back: the connection still works. */
    static String roundTrip(Connection c, String q) throws JMSException {
        Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
        try {
            Queue dest = s.createQueue(q);
            s.createProducer(dest).send(s.createTextMessage("ping"));
            return body(s.createConsumer(dest).receive(RECEIVE_MS));
        } finally {
            s.close();
        }
    }

    static List<String> bodies(String prefix, int n) {
        List<String> out = new ArrayList<>();
        for (int i = 0; i < n; i++) {
            out.add(prefix + i);
        }
        return out;
    }

    /** A TextMessage to send: body, application properties and headers. */
    static final class Spec {
        final String body;
        final Map<String, Object> props = new LinkedHashMap<>();
        int priority = Message.DEFAULT_PRIORITY;
        String type;
        String correlationId;

        Spec(String body) {
            this.body = body;
        }

        Spec p(String name, Object value) {
            props.put(name, value);
            return this;
        }

        Spec priority(int p) {
            priority = p;
            return this;
        }

        Spec type(String t) {
            type = t;
            return this;
        }

        Spec corr(String c) {
            correlationId = c;
            return this;
        }
    }

    static Spec msg(String body) {
        return new Spec(body);
    }

    static void send(Session s, MessageProducer p, List<Spec> specs) throws JMSException {
        for (Spec spec : specs) {
            TextMessage m = s.createTextMessage(spec.body);
            for (Map.Entry<String, Object> e : spec.props.entrySet()) {
                m.setObjectProperty(e.getKey(), e.getValue());
            }
            if (spec.type != null) {
                m.setJMSType(spec.type);
            }
            if (spec.correlationId != null) {
                m.setJMSCorrelationID(spec.correlationId);
            }
            p.send(m, DeliveryMode.PERSISTENT, spec.priority, Message.DEFAULT_TIME_TO_LIVE);
        }
    }

    /**
     * Receives from several consumers (in turns) until `expected` messages arrived in all or
     * nothing more comes; the bodies per consumer.
     */
    static List<List<String>> collect(List<MessageConsumer> consumers, int expected)
            throws JMSException {
        List<List<String>> got = new ArrayList<>();
        for (int i = 0; i < consumers.size(); i++) {
            got.add(new ArrayList<>());
        }
        int total = 0;
        long deadline = System.currentTimeMillis() + 2 * RECEIVE_MS;
        while (total < expected && System.currentTimeMillis() < deadline) {
            for (int i = 0; i < consumers.size(); i++) {
                Message m = consumers.get(i).receive(100);
                if (m != null) {
                    got.get(i).add(body(m));
                    total++;
                }
            }
        }
        for (int i = 0; i < consumers.size(); i++) { // duplicates would arrive now
            Message m = consumers.get(i).receive(QUIET_MS);
            while (m != null) {
                got.get(i).add(body(m));
                m = consumers.get(i).receive(QUIET_MS);
            }
        }
        return got;
    }

    /** Each message of `want` exactly once over all lists, nothing else. */
    static boolean exactlyOnce(List<List<String>> got, List<String> want) {
        List<String> all = new ArrayList<>();
        for (List<String> l : got) {
            all.addAll(l);
        }
        Collections.sort(all);
        List<String> sorted = new ArrayList<>(want);
        Collections.sort(sorted);
        return all.equals(sorted);
    }

    static List<Integer> sizes(List<List<String>> got) {
        List<Integer> out = new ArrayList<>();
        for (List<String> l : got) {
            out.add(l.size());
        }
        return out;
    }

    /** Exception class name, or null. */
    static String className(Throwable t) {
        return t == null ? null : t.getClass().getName();
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
        check("transacted", "sendCommit", r -> {
            Connection c = connect();
            Connection other = connect();
            try {
                Session ts = c.createSession(true, Session.SESSION_TRANSACTED);
                MessageProducer p = ts.createProducer(ts.createQueue(q + ".commit"));
                p.send(ts.createTextMessage("t1"));
                p.send(ts.createTextMessage("t2"));
                Session os = other.createSession(false, Session.AUTO_ACKNOWLEDGE);
                MessageConsumer oc = os.createConsumer(os.createQueue(q + ".commit"));
                List<String> before = receiveN(oc, 0); // uncommitted sends are invisible
                ts.commit();
                List<String> after = receiveN(oc, 2);
                r.put("beforeCommit", before);
                r.put("afterCommit", after);
                return before.isEmpty() && after.equals(Arrays.asList("t1", "t2"));
            } finally {
                closeQuietly(c);
                closeQuietly(other);
            }
        });
        check("transacted", "sendRollback", r -> {
            Connection c = connect();
            Connection other = connect();
            try {
                Session ts = c.createSession(true, Session.SESSION_TRANSACTED);
                MessageProducer p = ts.createProducer(ts.createQueue(q + ".rollback"));
                p.send(ts.createTextMessage("r1"));
                p.send(ts.createTextMessage("r2"));
                ts.rollback();
                p.send(ts.createTextMessage("r3"));
                ts.commit();
                Session os = other.createSession(false, Session.AUTO_ACKNOWLEDGE);
                List<String> got = receiveN(os.createConsumer(os.createQueue(q + ".rollback")), 1);
                r.put("received", got);
                return got.equals(Collections.singletonList("r3"));
            } finally {
                closeQuietly(c);
                closeQuietly(other);
            }
        });
        check("transacted", "receiveRollback", r -> {
            Connection c = connect();
            Connection other = connect();
            try {
                Session os = other.createSession(false, Session.AUTO_ACKNOWLEDGE);
                Queue dest = os.createQueue(q + ".receive");
                MessageProducer p = os.createProducer(dest);
                p.send(os.createTextMessage("a1"));
                p.send(os.createTextMessage("a2"));
                Session ts = c.createSession(true, Session.SESSION_TRANSACTED);
                MessageConsumer mc = ts.createConsumer(dest);
                List<String> first = new ArrayList<>();
                first.add(line(mc.receive(RECEIVE_MS)));
                first.add(line(mc.receive(RECEIVE_MS)));
                ts.rollback();
                List<String> again = new ArrayList<>();
                again.add(line(mc.receive(RECEIVE_MS)));
                again.add(line(mc.receive(RECEIVE_MS)));
                ts.commit();
                mc.close();
                // committed: removed from the queue
                List<String> left = receiveN(os.createConsumer(dest), 0);
                r.put("first", first);
                r.put("afterRollback", again);
                r.put("leftAfterCommit", left);
                return first.equals(Arrays.asList("a1|false|1", "a2|false|1"))
                    && again.equals(Arrays.asList("a1|true|2", "a2|true|2")) && left.isEmpty();
            } finally {
                closeQuietly(c);
                closeQuietly(other);
            }
        });
        check("transacted", "closeRollsBack", r -> {
            Connection c = connect();
            Connection other = connect();
            try {
                Session os = other.createSession(false, Session.AUTO_ACKNOWLEDGE);
                Queue dest = os.createQueue(q + ".close");
                os.createProducer(dest).send(os.createTextMessage("c1"));
                Session ts = c.createSession(true, Session.SESSION_TRANSACTED);
                String first = line(ts.createConsumer(dest).receive(RECEIVE_MS));
                ts.close(); // closing a transacted session rolls its transaction back
                String again = line(os.createConsumer(dest).receive(RECEIVE_MS));
                r.put("received", Arrays.asList(first, again));
                return "c1|false|1".equals(first) && "c1|true|2".equals(again);
            } finally {
                closeQuietly(c);
                closeQuietly(other);
            }
        });
        check("transacted", "consumeProduce", r -> {
            Connection c = connect();
            Connection other = connect();
            try {
                Session os = other.createSession(false, Session.AUTO_ACKNOWLEDGE);
                Queue in = os.createQueue(q + ".in");
                Queue out = os.createQueue(q + ".out");
                os.createProducer(in).send(os.createTextMessage("work"));
                MessageConsumer outConsumer = os.createConsumer(out);
                Session ts = c.createSession(true, Session.SESSION_TRANSACTED);
                MessageConsumer mc = ts.createConsumer(in);
                MessageProducer p = ts.createProducer(out);
                String first = line(mc.receive(RECEIVE_MS));
                p.send(ts.createTextMessage("result"));
                ts.rollback(); // neither the receive nor the send happened
                List<String> outAfterRollback = receiveN(outConsumer, 0);
                String again = line(mc.receive(RECEIVE_MS));
                p.send(ts.createTextMessage("result"));
                ts.commit(); // both happened
                List<String> outAfterCommit = receiveN(outConsumer, 1);
                mc.close();
                List<String> inAfterCommit = receiveN(os.createConsumer(in), 0);
                r.put("received", Arrays.asList(first, again));
                r.put("outAfterRollback", outAfterRollback);
                r.put("outAfterCommit", outAfterCommit);
                r.put("inAfterCommit", inAfterCommit);
                return "work|false|1".equals(first) && "work|true|2".equals(again)
                    && outAfterRollback.isEmpty()
                    && outAfterCommit.equals(Collections.singletonList("result"))
                    && inAfterCommit.isEmpty();
            } finally {
                closeQuietly(c);
                closeQuietly(other);
            }
        });
        check("transacted", "groupsRollback", r -> {
            // Two transacted consumers on a grouped queue (groups g-a, g-b, JMSXGroupSeq 1..6,
            // interleaved); each message is committed on its own except that the first
            // delivery of seq 3 of each group is rolled back. Every group must stay on one
            // consumer and arrive in order: 1 2 3 3(redelivered) 4 5 6.
            List<Connection> conns = new ArrayList<>();
            try {
                List<Session> sessions = new ArrayList<>();
                List<MessageConsumer> consumers = new ArrayList<>();
                for (int i = 0; i < 2; i++) {
                    Connection c = connect();
                    conns.add(c);
                    Session ts = c.createSession(true, Session.SESSION_TRANSACTED);
                    sessions.add(ts);
                    consumers.add(ts.createConsumer(ts.createQueue(q + ".groups")));
                }
                Connection pc = connect();
                conns.add(pc);
                Session ps = pc.createSession(false, Session.AUTO_ACKNOWLEDGE);
                MessageProducer p = ps.createProducer(ps.createQueue(q + ".groups"));
                int perGroup = 6;
                String[] groups = {"g-a", "g-b"};
                for (int seq = 1; seq <= perGroup; seq++) {
                    for (String g : groups) {
                        TextMessage m = ps.createTextMessage(g + "-" + seq);
                        m.setStringProperty("JMSXGroupID", g);
                        m.setIntProperty("JMSXGroupSeq", seq);
                        p.send(m);
                    }
                }
                Map<String, List<String>> log = new TreeMap<>();
                Map<String, Set<Integer>> owners = new TreeMap<>();
                Set<String> rolledBack = new TreeSet<>();
                int committed = 0;
                long deadline = System.currentTimeMillis() + 20000;
                while (committed < perGroup * groups.length
                        && System.currentTimeMillis() < deadline) {
                    for (int i = 0; i < 2; i++) {
                        Message m = consumers.get(i).receive(100);
                        if (m == null) {
                            continue;
                        }
                        String g = m.getStringProperty("JMSXGroupID");
                        int seq = m.getIntProperty("JMSXGroupSeq");
                        String entry = body(m) + (m.getJMSRedelivered()
                            ? "(r" + m.getIntProperty("JMSXDeliveryCount") + ")" : "");
                        log.computeIfAbsent(String.valueOf(g), k -> new ArrayList<>()).add(entry);
                        owners.computeIfAbsent(String.valueOf(g), k -> new TreeSet<>()).add(i);
                        if (seq == 3 && rolledBack.add(g)) {
                            sessions.get(i).rollback();
                        } else {
                            sessions.get(i).commit();
                            committed++;
                        }
                    }
                }
                List<String> extra = new ArrayList<>();
                for (int i = 0; i < 2; i++) {
                    Message m = consumers.get(i).receive(QUIET_MS);
                    if (m != null) {
                        extra.add(body(m));
                        sessions.get(i).commit();
                    }
                }
                List<String> split = new ArrayList<>();
                for (Map.Entry<String, Set<Integer>> e : owners.entrySet()) {
                    if (e.getValue().size() != 1) {
                        split.add(e.getKey() + "=" + e.getValue());
                    }
                }
                r.put("deliveries", log);
                r.put("split", split);
                r.put("extra", extra);
                boolean ok = split.isEmpty() && extra.isEmpty() && log.size() == 2;
                for (String g : groups) {
                    List<String> want = Arrays.asList(g + "-1", g + "-2", g + "-3",
                        g + "-3(r2)", g + "-4", g + "-5", g + "-6");
                    ok &= want.equals(log.get(g));
                }
                return ok;
            } finally {
                for (Connection c : conns) {
                    closeQuietly(c);
                }
            }
        });
    }

    // ------------------------------------------------------------------ clientid

    void clientId() {
        String cid = "interop-clientid-" + runId;
        String q = queueName("clientid");
        check("clientid", "duplicate", r -> {
            Connection first = connectAs(cid);
            try {
                Throwable error = null;
                Connection second = null;
                try {
                    second = connectAs(cid);
                    // a client that learns of the refusal late fails on first use
                    second.createSession(false, Session.AUTO_ACKNOWLEDGE).close();
                } catch (Throwable t) {
                    error = t;
                } finally {
                    closeQuietly(second);
                }
                r.put("exception", className(error));
                r.put("detail", error == null ? null : describe(error));
                String after = roundTrip(first, q);
                r.put("firstStillWorks", after);
                return error instanceof InvalidClientIDException && "ping".equals(after);
            } finally {
                closeQuietly(first);
            }
        });
        check("clientid", "reuseAfterClose", r -> {
            closeQuietly(connectAs(cid + ".reuse"));
            Connection again = connectAs(cid + ".reuse");
            try {
                String after = roundTrip(again, q);
                r.put("afterReuse", after);
                return "ping".equals(after);
            } finally {
                closeQuietly(again);
            }
        });
    }

    // ------------------------------------------------------------------ selectors

    /**
     * Sends `specs` to a fresh queue, then a consumer with `selector` must get exactly the
     * `matched` bodies (in order) while a second consumer without selector, opened next to it,
     * gets exactly the rest (in order).
     */
    void selectorCheck(String name, String selector, List<Spec> specs, List<String> matched) {
        String q = queueName("selectors") + "." + name;
        check("selectors", name, r -> {
            Connection c = connect();
            try {
                Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                Queue dest = s.createQueue(q);
                send(s, s.createProducer(dest), specs);
                r.put("selector", selector);
                MessageConsumer selecting = s.createConsumer(dest, selector);
                List<String> got = receiveN(selecting, matched.size());
                MessageConsumer plain = s.createConsumer(dest);
                List<String> rest = new ArrayList<>();
                for (Spec spec : specs) {
                    if (!matched.contains(spec.body)) {
                        rest.add(spec.body);
                    }
                }
                List<String> gotRest = receiveN(plain, rest.size());
                r.put("matched", got);
                r.put("rest", gotRest);
                return got.equals(matched) && gotRest.equals(rest);
            } finally {
                closeQuietly(c);
            }
        });
    }

    void selectors() {
        selectorCheck("andCompare", "color = 'red' AND weight > 10", Arrays.asList(
            msg("m0").p("color", "red").p("weight", 20),
            msg("m1").p("color", "red").p("weight", 5),
            msg("m2").p("color", "blue").p("weight", 30),
            msg("m3").p("color", "red").p("weight", 11),
            msg("m4")), Arrays.asList("m0", "m3"));
        selectorCheck("likeEscape", "name LIKE 'a\\_%' ESCAPE '\\'", Arrays.asList(
            msg("m0").p("name", "a_b"),
            msg("m1").p("name", "abb"), // would match if the escape were ignored
            msg("m2").p("name", "a_"),
            msg("m3").p("name", "xa_b"),
            msg("m4")), Arrays.asList("m0", "m2"));
        selectorCheck("in", "color IN ('red', 'green')", Arrays.asList(
            msg("m0").p("color", "red"),
            msg("m1").p("color", "blue"),
            msg("m2").p("color", "green"),
            msg("m3"), // NULL IN (...) is unknown: not selected
            msg("m4").p("color", "Red")), Arrays.asList("m0", "m2"));
        selectorCheck("between", "weight BETWEEN 10 AND 20", Arrays.asList(
            msg("m0").p("weight", 9),
            msg("m1").p("weight", 10),
            msg("m2").p("weight", 15.5),
            msg("m3").p("weight", 20L),
            msg("m4").p("weight", 21),
            msg("m5")), Arrays.asList("m1", "m2", "m3"));
        selectorCheck("isNull", "color IS NULL", Arrays.asList(
            msg("m0").p("color", "red"),
            msg("m1"),
            msg("m2").p("color", "blue"),
            msg("m3").p("weight", 1)), Arrays.asList("m1", "m3"));
        selectorCheck("isNotNull", "color IS NOT NULL AND NOT (color = 'blue')", Arrays.asList(
            msg("m0").p("color", "red"),
            msg("m1"),
            msg("m2").p("color", "blue"),
            msg("m3").p("color", "green")), Arrays.asList("m0", "m3"));
        selectorCheck("priority", "JMSPriority > 6", Arrays.asList(
            msg("m0").priority(4),
            msg("m1").priority(9),
            msg("m2").priority(7),
            msg("m3").priority(0)), Arrays.asList("m1", "m2"));
        selectorCheck("type", "JMSType = 'order'", Arrays.asList(
            msg("m0").type("order"),
            msg("m1").type("invoice"),
            msg("m2").type("order"),
            msg("m3")), Arrays.asList("m0", "m2"));
        selectorCheck("correlationId", "JMSCorrelationID IN ('c-1', 'c-3')", Arrays.asList(
            msg("m0").corr("c-1"),
            msg("m1").corr("c-2"),
            msg("m2").corr("c-3"),
            msg("m3")), Arrays.asList("m0", "m2"));
        selectorCheck("groupId", "JMSXGroupID = 'g-a'", Arrays.asList(
            msg("a1").p("JMSXGroupID", "g-a").p("JMSXGroupSeq", 1),
            msg("b1").p("JMSXGroupID", "g-b").p("JMSXGroupSeq", 1),
            msg("a2").p("JMSXGroupID", "g-a").p("JMSXGroupSeq", 2),
            msg("b2").p("JMSXGroupID", "g-b").p("JMSXGroupSeq", 2),
            msg("u1")), Arrays.asList("a1", "a2"));
        selectorCheck("groupSeq", "JMSXGroupSeq <= 3", Arrays.asList(
            msg("a1").p("JMSXGroupID", "g-a").p("JMSXGroupSeq", 1),
            msg("b5").p("JMSXGroupID", "g-b").p("JMSXGroupSeq", 5),
            msg("a2").p("JMSXGroupID", "g-a").p("JMSXGroupSeq", 2),
            msg("b6").p("JMSXGroupID", "g-b").p("JMSXGroupSeq", 6),
            msg("a3").p("JMSXGroupID", "g-a").p("JMSXGroupSeq", 3)),
            Arrays.asList("a1", "a2", "a3"));
        // Messages sent while the selecting consumer is already attached.
        String q = queueName("selectors");
        check("selectors", "liveConsumers", r -> {
            Connection c = connect();
            try {
                Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                Queue dest = s.createQueue(q + ".live");
                MessageConsumer red = s.createConsumer(dest, "color = 'red'");
                MessageConsumer blue = s.createConsumer(dest, "color = 'blue'");
                List<Spec> specs = new ArrayList<>();
                for (int i = 0; i < 6; i++) {
                    specs.add(msg((i % 2 == 0 ? "red" : "blue") + i)
                        .p("color", i % 2 == 0 ? "red" : "blue"));
                }
                specs.add(msg("green6").p("color", "green"));
                send(s, s.createProducer(dest), specs);
                List<String> gotRed = receiveN(red, 3);
                List<String> gotBlue = receiveN(blue, 3);
                List<String> gotRest = receiveN(s.createConsumer(dest), 1);
                r.put("red", gotRed);
                r.put("blue", gotBlue);
                r.put("rest", gotRest);
                return gotRed.equals(Arrays.asList("red0", "red2", "red4"))
                    && gotBlue.equals(Arrays.asList("blue1", "blue3", "blue5"))
                    && gotRest.equals(Collections.singletonList("green6"));
            } finally {
                closeQuietly(c);
            }
        });
        for (final boolean clientSide : new boolean[] {true, false}) {
            // The client validates selectors itself unless jms.validateSelector=false; then the
            // broker must refuse the consumer.
            check("selectors", clientSide ? "invalidClientSide" : "invalidBrokerSide", r -> {
                Connection c = connect(clientSide ? null : "jms.validateSelector=false");
                try {
                    Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                    Throwable error = null;
                    try {
                        s.createConsumer(s.createQueue(q + ".invalid"), "color = = 'red' AND");
                    } catch (Throwable t) {
                        error = t;
                    }
                    r.put("exception", className(error));
                    r.put("detail", error == null ? null : describe(error));
                    String after = roundTrip(c, q + ".invalid");
                    r.put("connectionStillWorks", after);
                    boolean refused = clientSide ? error instanceof InvalidSelectorException
                        : error instanceof JMSException;
                    return refused && "ping".equals(after);
                } finally {
                    closeQuietly(c);
                }
            });
        }
    }

    // ------------------------------------------------------------------ topics

    void topics() {
        String t = queueName("topics");
        check("topics", "subscribers", r -> {
            Connection c1 = connect();
            Connection c2 = connect();
            Connection pc = connect();
            try {
                Session ps = pc.createSession(false, Session.AUTO_ACKNOWLEDGE);
                MessageProducer p = ps.createProducer(ps.createTopic(t + ".plain"));
                p.send(ps.createTextMessage("before")); // no subscriber yet: nobody gets it
                Session s1 = c1.createSession(false, Session.AUTO_ACKNOWLEDGE);
                Session s2 = c2.createSession(false, Session.AUTO_ACKNOWLEDGE);
                MessageConsumer a = s1.createConsumer(s1.createTopic(t + ".plain"));
                MessageConsumer b = s1.createConsumer(s1.createTopic(t + ".plain"));
                MessageConsumer other = s2.createConsumer(s2.createTopic(t + ".plain"));
                for (int i = 0; i < 3; i++) {
                    p.send(ps.createTextMessage("t" + i));
                }
                List<String> want = bodies("t", 3);
                List<String> ga = receiveN(a, 3);
                List<String> gb = receiveN(b, 3);
                List<String> go = receiveN(other, 3);
                r.put("subscriber1", ga);
                r.put("subscriber2SameSession", gb);
                r.put("subscriber3OtherConnection", go);
                return ga.equals(want) && gb.equals(want) && go.equals(want);
            } finally {
                closeQuietly(c1);
                closeQuietly(c2);
                closeQuietly(pc);
            }
        });
        check("topics", "noLocal", r -> {
            Connection c1 = connect();
            Connection c2 = connect();
            try {
                Session s1 = c1.createSession(false, Session.AUTO_ACKNOWLEDGE);
                Session s2 = c2.createSession(false, Session.AUTO_ACKNOWLEDGE);
                Topic topic1 = s1.createTopic(t + ".nolocal");
                Topic topic2 = s2.createTopic(t + ".nolocal");
                MessageConsumer noLocal = s1.createConsumer(topic1, null, true);
                MessageConsumer local = s1.createConsumer(topic1);
                MessageConsumer remote = s2.createConsumer(topic2);
                MessageProducer p1 = s1.createProducer(topic1);
                MessageProducer p2 = s2.createProducer(topic2);
                p1.send(s1.createTextMessage("local-1"));
                p2.send(s2.createTextMessage("remote-1"));
                p1.send(s1.createTextMessage("local-2"));
                List<String> all = Arrays.asList("local-1", "remote-1", "local-2");
                List<String> gn = receiveN(noLocal, 1);
                List<String> gl = receiveN(local, 3);
                List<String> gr = receiveN(remote, 3);
                r.put("noLocal", gn);
                r.put("sameConnection", gl);
                r.put("otherConnection", gr);
                return gn.equals(Collections.singletonList("remote-1")) && gl.equals(all)
                    && gr.equals(all);
            } finally {
                closeQuietly(c1);
                closeQuietly(c2);
            }
        });
        check("topics", "temporaryTopic", r -> {
            Connection requester = connect();
            Connection responder = connect();
            try {
                Session rs = requester.createSession(false, Session.AUTO_ACKNOWLEDGE);
                TemporaryTopic tt = rs.createTemporaryTopic();
                MessageConsumer replies = rs.createConsumer(tt);
                Session ss = responder.createSession(false, Session.AUTO_ACKNOWLEDGE);
                MessageConsumer requests = ss.createConsumer(ss.createQueue(t + ".requests"));
                TextMessage req = rs.createTextMessage("request");
                req.setJMSReplyTo(tt);
                rs.createProducer(rs.createQueue(t + ".requests")).send(req);
                Message got = requests.receive(RECEIVE_MS);
                r.put("request", body(got));
                if (got == null) {
                    return false;
                }
                Destination replyTo = got.getJMSReplyTo();
                r.put("replyToIsTemporaryTopic", replyTo instanceof TemporaryTopic);
                boolean sameName = replyTo instanceof Topic
                    && tt.getTopicName().equals(((Topic) replyTo).getTopicName());
                r.put("replyToNameMatches", sameName);
                TextMessage reply = ss.createTextMessage("reply");
                reply.setJMSCorrelationID(got.getJMSMessageID());
                ss.createProducer(replyTo).send(reply);
                Message answer = replies.receive(RECEIVE_MS);
                r.put("reply", body(answer));
                boolean corr = answer != null
                    && req.getJMSMessageID().equals(answer.getJMSCorrelationID());
                r.put("correlationMatches", corr);
                replies.close();
                tt.delete();
                r.put("deleted", true);
                return "reply".equals(body(answer)) && corr && sameName
                    && replyTo instanceof TemporaryTopic;
            } finally {
                closeQuietly(responder);
                closeQuietly(requester);
            }
        });
    }

    // ------------------------------------------------------------------ durable subscriptions

    /** Unsubscribes quietly (cleanup only). */
    static void unsubscribeQuietly(Session s, String name) {
        try {
            s.unsubscribe(name);
        } catch (Throwable t) {
            System.err.println("unsubscribe " + name + " failed: " + describe(t));
        }
    }

    void durableSubs() {
        String t = queueName("durable-subs");
        String cid = "interop-durable-subs-" + runId;
        check("durable-subs", "detached", r -> {
            Connection c = connectAs(cid + ".1");
            try {
                Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                Topic topic = s.createTopic(t + ".detached");
                MessageProducer p = s.createProducer(topic);
                MessageConsumer d = s.createDurableConsumer(topic, "sub1");
                p.send(s.createTextMessage("d0"));
                List<String> attached = receiveN(d, 1);
                d.close();
                p.send(s.createTextMessage("d1"));
                p.send(s.createTextMessage("d2"));
                d = s.createDurableConsumer(topic, "sub1");
                List<String> reattached = receiveN(d, 2);
                d.close();
                unsubscribeQuietly(s, "sub1");
                r.put("attached", attached);
                r.put("afterReattach", reattached);
                return attached.equals(Collections.singletonList("d0"))
                    && reattached.equals(Arrays.asList("d1", "d2"));
            } finally {
                closeQuietly(c);
            }
        });
        check("durable-subs", "reconnect", r -> {
            Connection c = connectAs(cid + ".2");
            Connection pc = connect();
            try {
                Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                s.createDurableConsumer(s.createTopic(t + ".reconnect"), "sub2");
                closeQuietly(c); // the subscription outlives its connection
                Session ps = pc.createSession(false, Session.AUTO_ACKNOWLEDGE);
                MessageProducer p = ps.createProducer(ps.createTopic(t + ".reconnect"));
                p.send(ps.createTextMessage("e0"));
                p.send(ps.createTextMessage("e1"));
                c = connectAs(cid + ".2");
                s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                MessageConsumer d = s.createDurableConsumer(s.createTopic(t + ".reconnect"), "sub2");
                List<String> got = receiveN(d, 2);
                d.close();
                unsubscribeQuietly(s, "sub2");
                r.put("afterReconnect", got);
                return got.equals(Arrays.asList("e0", "e1"));
            } finally {
                closeQuietly(c);
                closeQuietly(pc);
            }
        });
        check("durable-subs", "selector", r -> {
            Connection c = connectAs(cid + ".3");
            try {
                Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                Topic topic = s.createTopic(t + ".selector");
                MessageProducer p = s.createProducer(topic);
                String selector = "color = 'red'";
                MessageConsumer d = s.createDurableConsumer(topic, "sub-sel", selector, false);
                send(s, p, Arrays.asList(msg("red-0").p("color", "red"),
                    msg("blue-0").p("color", "blue"), msg("red-1").p("color", "red")));
                List<String> attached = receiveN(d, 2);
                d.close();
                send(s, p, Arrays.asList(msg("blue-1").p("color", "blue"),
                    msg("red-2").p("color", "red"), msg("none-0")));
                d = s.createDurableConsumer(topic, "sub-sel", selector, false);
                List<String> reattached = receiveN(d, 1);
                d.close();
                unsubscribeQuietly(s, "sub-sel");
                r.put("attached", attached);
                r.put("afterReattach", reattached);
                return attached.equals(Arrays.asList("red-0", "red-1"))
                    && reattached.equals(Collections.singletonList("red-2"));
            } finally {
                closeQuietly(c);
            }
        });
        check("durable-subs", "unsubscribe", r -> {
            Connection c = connectAs(cid + ".4");
            try {
                Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                Topic topic = s.createTopic(t + ".unsubscribe");
                MessageProducer p = s.createProducer(topic);
                s.createDurableConsumer(topic, "sub-u").close();
                p.send(s.createTextMessage("u0")); // kept for the subscription...
                s.unsubscribe("sub-u"); // ...until it is removed
                p.send(s.createTextMessage("u1")); // no subscription: nobody gets it
                MessageConsumer d = s.createDurableConsumer(topic, "sub-u");
                List<String> fresh = receiveN(d, 0);
                p.send(s.createTextMessage("u2"));
                List<String> later = receiveN(d, 1);
                d.close();
                unsubscribeQuietly(s, "sub-u");
                r.put("afterResubscribe", fresh);
                r.put("newMessages", later);
                return fresh.isEmpty() && later.equals(Collections.singletonList("u2"));
            } finally {
                closeQuietly(c);
            }
        });
        check("durable-subs", "unsubscribeUnknown", r -> {
            Connection c = connectAs(cid + ".5");
            try {
                Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                Throwable error = null;
                try {
                    s.unsubscribe("no-such-subscription");
                } catch (Throwable e) {
                    error = e;
                }
                r.put("exception", className(error));
                r.put("detail", error == null ? null : describe(error));
                String after = roundTrip(c, queueName("durable-subs"));
                r.put("connectionStillWorks", after);
                return error instanceof InvalidDestinationException && "ping".equals(after);
            } finally {
                closeQuietly(c);
            }
        });
        check("durable-subs", "unsubscribeWhileActive", r -> {
            Connection c = connectAs(cid + ".6");
            try {
                Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                Topic topic = s.createTopic(t + ".active");
                MessageConsumer d = s.createDurableConsumer(topic, "sub-a");
                Throwable error = null;
                try {
                    s.unsubscribe("sub-a"); // erroneous while a consumer is open (JMS 2 6.11.1)
                } catch (Throwable e) {
                    error = e;
                }
                r.put("exception", className(error));
                r.put("detail", error == null ? null : describe(error));
                s.createProducer(topic).send(s.createTextMessage("still-subscribed"));
                List<String> got = receiveN(d, 1);
                r.put("afterwards", got);
                d.close();
                unsubscribeQuietly(s, "sub-a");
                return error instanceof JMSException
                    && got.equals(Collections.singletonList("still-subscribed"));
            } finally {
                closeQuietly(c);
            }
        });
    }

    /** Restart check, phase 1: two detached durable subscriptions with messages waiting. */
    void durableSubSend() {
        String t = queueName("durable-sub-restart");
        String cid = "interop-durable-sub-restart-" + runId;
        check("durable-sub-send", "sent", r -> {
            Connection c = connectAs(cid);
            try {
                Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                Topic topic = s.createTopic(t);
                s.createDurableConsumer(topic, "restart-all").close();
                s.createDurableConsumer(topic, "restart-sel", "n >= 1", false).close();
                MessageProducer p = s.createProducer(topic);
                for (int i = 0; i < 3; i++) {
                    TextMessage m = s.createTextMessage("persistent-" + i);
                    m.setStringProperty("phase", "before-restart");
                    m.setIntProperty("n", i);
                    p.send(m, DeliveryMode.PERSISTENT, 7, Message.DEFAULT_TIME_TO_LIVE);
                }
                TextMessage np = s.createTextMessage("non-persistent");
                np.setIntProperty("n", 9);
                p.send(np, DeliveryMode.NON_PERSISTENT, Message.DEFAULT_PRIORITY,
                    Message.DEFAULT_TIME_TO_LIVE);
                r.put("topic", t);
                r.put("sent", 4);
                return true;
            } finally {
                closeQuietly(c);
            }
        });
    }

    /** Phase 2, after a broker restart: both subscriptions exist with their persistent messages. */
    void durableSubReceive() {
        String t = queueName("durable-sub-restart");
        String cid = "interop-durable-sub-restart-" + runId;
        check("durable-sub-receive", "afterRestart", r -> {
            Connection c = connectAs(cid);
            try {
                Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                Topic topic = s.createTopic(t);
                Map<String, List<String>> got = new LinkedHashMap<>();
                for (String sub : new String[] {"restart-all", "restart-sel"}) {
                    MessageConsumer d = sub.equals("restart-sel")
                        ? s.createDurableConsumer(topic, sub, "n >= 1", false)
                        : s.createDurableConsumer(topic, sub);
                    List<String> lines = new ArrayList<>();
                    for (int i = 0; i < 4; i++) {
                        Message m = d.receive(i == 0 ? RECEIVE_MS : QUIET_MS);
                        if (m == null) {
                            break;
                        }
                        lines.add(body(m) + "|" + m.getJMSDeliveryMode() + "|"
                            + m.getJMSPriority() + "|" + m.getStringProperty("phase") + "|"
                            + propertyValue(m, "n"));
                    }
                    got.put(sub, lines);
                    d.close();
                }
                // the subscriptions are still there after the restart: a new message reaches both
                s.createProducer(topic).send(s.createTextMessage("after-restart"));
                List<String> newAll = receiveN(s.createDurableConsumer(topic, "restart-all"), 1);
                r.put("received", got);
                r.put("newMessage", newAll);
                return got.get("restart-all").equals(Arrays.asList(
                        "persistent-0|2|7|before-restart|0", "persistent-1|2|7|before-restart|1",
                        "persistent-2|2|7|before-restart|2"))
                    && got.get("restart-sel").equals(Arrays.asList(
                        "persistent-1|2|7|before-restart|1", "persistent-2|2|7|before-restart|2"))
                    && newAll.equals(Collections.singletonList("after-restart"));
            } finally {
                closeQuietly(c);
            }
        });
    }

    // ------------------------------------------------------------------ shared subscriptions

    void sharedSubs() {
        String t = queueName("shared-subs");
        String cid = "interop-shared-subs-" + runId;
        final int n = 10;
        for (final boolean withClientId : new boolean[] {false, true}) {
            // Without clientID the subscription is global and the consumers sit on two
            // connections; with one, both consumers use one connection (two sessions).
            String suffix = withClientId ? "ClientId" : "Global";
            check("shared-subs", "volatile" + suffix, r -> {
                List<Connection> conns = new ArrayList<>();
                try {
                    List<MessageConsumer> consumers = new ArrayList<>();
                    Connection first = withClientId ? connectAs(cid + ".v") : connect();
                    conns.add(first);
                    for (int i = 0; i < 2; i++) {
                        Connection c = first;
                        if (i == 1 && !withClientId) {
                            c = connect();
                            conns.add(c);
                        }
                        Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                        consumers.add(s.createSharedConsumer(s.createTopic(t + ".v" + suffix),
                            "shared-v." + runId));
                    }
                    Connection pc = connect();
                    conns.add(pc);
                    Session ps = pc.createSession(false, Session.AUTO_ACKNOWLEDGE);
                    Topic topic = ps.createTopic(t + ".v" + suffix);
                    MessageConsumer plain = ps.createConsumer(topic); // its own copy of each
                    MessageProducer p = ps.createProducer(topic);
                    for (int i = 0; i < n; i++) {
                        p.send(ps.createTextMessage("s" + i));
                    }
                    List<List<String>> got = collect(consumers, n);
                    List<String> gotPlain = receiveN(plain, n);
                    r.put("perConsumer", sizes(got));
                    r.put("exactlyOnce", exactlyOnce(got, bodies("s", n)));
                    r.put("plainSubscriber", gotPlain);
                    return exactlyOnce(got, bodies("s", n)) && gotPlain.equals(bodies("s", n));
                } finally {
                    for (Connection c : conns) {
                        closeQuietly(c);
                    }
                }
            });
            check("shared-subs", "durable" + suffix, r -> {
                List<Connection> conns = new ArrayList<>();
                try {
                    List<Session> sessions = new ArrayList<>();
                    List<MessageConsumer> consumers = new ArrayList<>();
                    Connection first = withClientId ? connectAs(cid + ".d") : connect();
                    conns.add(first);
                    String name = "shared-d." + runId;
                    for (int i = 0; i < 2; i++) {
                        Connection c = first;
                        if (i == 1 && !withClientId) {
                            c = connect();
                            conns.add(c);
                        }
                        Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                        sessions.add(s);
                        consumers.add(s.createSharedDurableConsumer(
                            s.createTopic(t + ".d" + suffix), name));
                    }
                    Session s0 = sessions.get(0);
                    Topic topic = s0.createTopic(t + ".d" + suffix);
                    MessageProducer p = s0.createProducer(topic);
                    for (int i = 0; i < n; i++) {
                        p.send(s0.createTextMessage("s" + i));
                    }
                    List<List<String>> got = collect(consumers, n);
                    r.put("perConsumer", sizes(got));
                    r.put("exactlyOnce", exactlyOnce(got, bodies("s", n)));
                    for (MessageConsumer mc : consumers) {
                        mc.close();
                    }
                    p.send(s0.createTextMessage("detached-0"));
                    p.send(s0.createTextMessage("detached-1"));
                    MessageConsumer again = sessions.get(1).createSharedDurableConsumer(
                        sessions.get(1).createTopic(t + ".d" + suffix), name);
                    List<String> reattached = receiveN(again, 2);
                    again.close();
                    s0.unsubscribe(name);
                    p.send(s0.createTextMessage("after-unsubscribe"));
                    MessageConsumer fresh = s0.createSharedDurableConsumer(topic, name);
                    List<String> afterUnsubscribe = receiveN(fresh, 0);
                    fresh.close();
                    unsubscribeQuietly(s0, name);
                    r.put("afterReattach", reattached);
                    r.put("afterUnsubscribe", afterUnsubscribe);
                    return exactlyOnce(got, bodies("s", n))
                        && reattached.equals(Arrays.asList("detached-0", "detached-1"))
                        && afterUnsubscribe.isEmpty();
                } finally {
                    for (Connection c : conns) {
                        closeQuietly(c);
                    }
                }
            });
        }
        check("shared-subs", "volatileRemoved", r -> {
            // A shared non-durable subscription ends with its last consumer.
            Connection c = connect();
            try {
                Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                Topic topic = s.createTopic(t + ".removed");
                MessageProducer p = s.createProducer(topic);
                MessageConsumer mc = s.createSharedConsumer(topic, "shared-r." + runId);
                p.send(s.createTextMessage("while-open"));
                List<String> open = receiveN(mc, 1);
                mc.close();
                p.send(s.createTextMessage("while-closed"));
                mc = s.createSharedConsumer(topic, "shared-r." + runId);
                List<String> reopened = receiveN(mc, 0);
                r.put("whileOpen", open);
                r.put("afterReopen", reopened);
                return open.equals(Collections.singletonList("while-open")) && reopened.isEmpty();
            } finally {
                closeQuietly(c);
            }
        });
    }

    // ------------------------------------------------------------------ browser

    static List<String> browse(QueueBrowser b) throws JMSException {
        List<String> got = new ArrayList<>();
        Enumeration<?> e = b.getEnumeration();
        while (e.hasMoreElements()) {
            got.add(body((Message) e.nextElement()));
        }
        return got;
    }

    void browser() {
        String q = queueName("browser");
        check("browser", "browse", r -> {
            Connection c = connect();
            try {
                Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                Queue dest = s.createQueue(q);
                MessageProducer p = s.createProducer(dest);
                for (int i = 0; i < 5; i++) {
                    p.send(s.createTextMessage("b" + i));
                }
                QueueBrowser b = s.createBrowser(dest);
                List<String> first = browse(b);
                b.close();
                List<String> second = browse(s.createBrowser(dest)); // nothing was consumed
                List<String> consumed = receiveN(s.createConsumer(dest), 5);
                List<String> afterwards = browse(s.createBrowser(dest));
                r.put("firstBrowse", first);
                r.put("secondBrowse", second);
                r.put("consumed", consumed);
                r.put("browseAfterConsume", afterwards);
                List<String> want = bodies("b", 5);
                return first.equals(want) && second.equals(want) && consumed.equals(want)
                    && afterwards.isEmpty();
            } finally {
                closeQuietly(c);
            }
        });
        check("browser", "selector", r -> {
            Connection c = connect();
            try {
                Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                Queue dest = s.createQueue(q + ".selector");
                List<Spec> specs = new ArrayList<>();
                for (int i = 0; i < 6; i++) {
                    specs.add(msg("b" + i).p("color", i % 2 == 0 ? "red" : "blue"));
                }
                send(s, s.createProducer(dest), specs);
                List<String> red = browse(s.createBrowser(dest, "color = 'red'"));
                List<String> consumed = receiveN(s.createConsumer(dest), 6);
                r.put("browsed", red);
                r.put("consumed", consumed);
                return red.equals(Arrays.asList("b0", "b2", "b4"))
                    && consumed.equals(bodies("b", 6));
            } finally {
                closeQuietly(c);
            }
        });
        check("browser", "withConsumer", r -> {
            // A browser next to an open consumer that holds some messages unacknowledged
            // sees the ones still available, and takes none of them away.
            Connection c = connect();
            try {
                Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                Queue dest = s.createQueue(q + ".consumer");
                MessageProducer p = s.createProducer(dest);
                for (int i = 0; i < 4; i++) {
                    p.send(s.createTextMessage("b" + i));
                }
                MessageConsumer mc = s.createConsumer(dest);
                String first = body(mc.receive(RECEIVE_MS));
                List<String> browsed = browse(s.createBrowser(dest));
                List<String> rest = receiveN(mc, 3);
                r.put("first", first);
                r.put("browsed", browsed);
                r.put("rest", rest);
                // the consumer may have prefetched b1..b3: the browser sees those or nothing
                boolean browsedOk = browsed.isEmpty()
                    || browsed.equals(Arrays.asList("b1", "b2", "b3"));
                return "b0".equals(first) && browsedOk
                    && rest.equals(Arrays.asList("b1", "b2", "b3"));
            } finally {
                closeQuietly(c);
            }
        });
    }

    // ------------------------------------------------------------------ delay

    void delay() {
        String q = queueName("delay");
        check("delay", "deliveryDelay", r -> {
            Connection c = connect();
            try {
                Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                Queue dest = s.createQueue(q);
                MessageConsumer mc = s.createConsumer(dest);
                MessageProducer delayed = s.createProducer(dest);
                delayed.setDeliveryDelay(DELAY_MS);
                MessageProducer immediate = s.createProducer(dest);
                long t0 = System.currentTimeMillis();
                delayed.send(s.createTextMessage("delayed"));
                immediate.send(s.createTextMessage("immediate"));
                Message a = mc.receive(RECEIVE_MS);
                long ta = System.currentTimeMillis() - t0;
                Message b = mc.receive(DELAY_MS + RECEIVE_MS);
                long tb = System.currentTimeMillis() - t0;
                List<String> extra = receiveN(mc, 0);
                r.put("order", Arrays.asList(body(a), body(b)));
                r.put("millis", Arrays.asList(ta, tb));
                boolean immediateFirst = a != null && ta < DELAY_MS - 300;
                boolean notEarly = b != null && tb >= DELAY_MS - 50;
                boolean inTime = b != null && tb < DELAY_MS + 3000;
                r.put("immediateNotHeldBack", immediateFirst);
                r.put("delayedNotBeforeDelay", notEarly);
                r.put("delayedSoonAfterDelay", inTime);
                boolean deliveryTime = b != null && b.getJMSDeliveryTime() >= t0 + DELAY_MS;
                r.put("deliveryTimeHeader", deliveryTime);
                r.put("extra", extra);
                return "immediate".equals(body(a)) && "delayed".equals(body(b)) && immediateFirst
                    && notEarly && inTime && deliveryTime && extra.isEmpty();
            } finally {
                closeQuietly(c);
            }
        });
        check("delay", "groupNotOvertaken", r -> {
            // g1's first message is delayed: g1's second (not delayed) must wait for it; g2
            // is not held back.
            Connection c = connect();
            try {
                Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                Queue dest = s.createQueue(q + ".groups");
                MessageConsumer mc = s.createConsumer(dest);
                MessageProducer delayed = s.createProducer(dest);
                delayed.setDeliveryDelay(DELAY_MS);
                MessageProducer immediate = s.createProducer(dest);
                long t0 = System.currentTimeMillis();
                TextMessage m = s.createTextMessage("g1-1");
                m.setStringProperty("JMSXGroupID", "g1");
                m.setIntProperty("JMSXGroupSeq", 1);
                delayed.send(m);
                m = s.createTextMessage("g1-2");
                m.setStringProperty("JMSXGroupID", "g1");
                m.setIntProperty("JMSXGroupSeq", 2);
                immediate.send(m);
                m = s.createTextMessage("g2-1");
                m.setStringProperty("JMSXGroupID", "g2");
                m.setIntProperty("JMSXGroupSeq", 1);
                immediate.send(m);
                List<String> order = new ArrayList<>();
                List<Long> millis = new ArrayList<>();
                for (int i = 0; i < 3; i++) {
                    Message got = mc.receive(DELAY_MS + RECEIVE_MS);
                    if (got == null) {
                        break;
                    }
                    order.add(body(got));
                    millis.add(System.currentTimeMillis() - t0);
                }
                List<String> extra = receiveN(mc, 0);
                r.put("order", order);
                r.put("millis", millis);
                r.put("extra", extra);
                boolean timing = millis.size() == 3 && millis.get(0) < DELAY_MS - 300
                    && millis.get(1) >= DELAY_MS - 50;
                r.put("timing", timing);
                return order.equals(Arrays.asList("g2-1", "g1-1", "g1-2")) && timing
                    && extra.isEmpty();
            } finally {
                closeQuietly(c);
            }
        });
    }

    // ------------------------------------------------------------------ message types

    /** The ObjectMessage payload: a Serializable of this program's own class. */
    static final class Payload implements Serializable {
        private static final long serialVersionUID = 1L;
        final String name;
        final int number;
        final List<String> tags;

        Payload(String name, int number, List<String> tags) {
            this.name = name;
            this.number = number;
            this.tags = new ArrayList<>(tags);
        }

        @Override
        public boolean equals(Object o) {
            if (!(o instanceof Payload)) {
                return false;
            }
            Payload p = (Payload) o;
            return name.equals(p.name) && number == p.number && tags.equals(p.tags);
        }

        @Override
        public int hashCode() {
            return Objects.hash(name, number, tags);
        }

        @Override
        public String toString() {
            return "Payload(" + name + "," + number + "," + tags + ")";
        }
    }

    interface Maker {
        Message make(Session s) throws JMSException;
    }

    interface Reader {
        Object read(Message m) throws JMSException;
    }

    static String typedValue(Object v) {
        if (v instanceof byte[]) {
            return "byte[]:" + Arrays.toString((byte[]) v);
        }
        return typed(v);
    }

    void typeCheck(String name, Class<?> type, Maker maker, Reader reader, Object want) {
        String q = queueName("message-types") + "." + name;
        check("message-types", name, r -> {
            Connection c = connect();
            try {
                Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                Queue dest = s.createQueue(q);
                Message sent = maker.make(s);
                sent.setStringProperty("kind", name);
                s.createProducer(dest).send(sent);
                Message m = s.createConsumer(dest).receive(RECEIVE_MS);
                if (m == null) {
                    r.put("received", null);
                    return false;
                }
                r.put("type", m.getClass().getSimpleName());
                Object got = reader.read(m);
                r.put("content", got);
                r.put("kind", m.getStringProperty("kind"));
                return type.isInstance(m) && Objects.equals(got, want)
                    && name.equals(m.getStringProperty("kind"));
            } finally {
                closeQuietly(c);
            }
        });
    }

    void messageTypes() {
        String text = "h\u00e9llo, w\u00f6rld \u2713 \ud834\udd1e";
        typeCheck("text", TextMessage.class, s -> s.createTextMessage(text),
            m -> ((TextMessage) m).getText(), text);
        typeCheck("textNull", TextMessage.class, s -> s.createTextMessage(),
            m -> String.valueOf(((TextMessage) m).getText()), "null");
        List<String> bytesWant = Arrays.asList("true", "-1", "-2", "Z", "123456789",
            "-9876543210", "1.5", "-2.25", "utf \u2713", "[0, 1, -1]", "len=42");
        typeCheck("bytes", BytesMessage.class, s -> {
            BytesMessage b = s.createBytesMessage();
            b.writeBoolean(true);
            b.writeByte((byte) -1);
            b.writeShort((short) -2);
            b.writeChar('Z');
            b.writeInt(123456789);
            b.writeLong(-9876543210L);
            b.writeFloat(1.5f);
            b.writeDouble(-2.25);
            b.writeUTF("utf \u2713");
            b.writeBytes(new byte[] {0, 1, (byte) 255});
            return b;
        }, m -> {
            BytesMessage b = (BytesMessage) m;
            List<String> out = new ArrayList<>();
            out.add(String.valueOf(b.readBoolean()));
            out.add(String.valueOf(b.readByte()));
            out.add(String.valueOf(b.readShort()));
            out.add(String.valueOf(b.readChar()));
            out.add(String.valueOf(b.readInt()));
            out.add(String.valueOf(b.readLong()));
            out.add(String.valueOf(b.readFloat()));
            out.add(String.valueOf(b.readDouble()));
            out.add(b.readUTF());
            byte[] rest = new byte[3];
            b.readBytes(rest);
            out.add(Arrays.toString(rest));
            out.add("len=" + b.getBodyLength());
            return out;
        }, bytesWant);
        Map<String, String> mapWant = new TreeMap<>();
        mapWant.put("b", "Boolean:true");
        mapWant.put("by", "Byte:-3");
        mapWant.put("bytes", "byte[]:[1, 2, 3]");
        mapWant.put("c", "Character:x");
        mapWant.put("d", "Double:2.5");
        mapWant.put("f", "Float:0.25");
        mapWant.put("i", "Integer:42");
        mapWant.put("l", "Long:10000000000");
        mapWant.put("s", "String:v \u2713");
        mapWant.put("sh", "Short:-7");
        typeCheck("map", MapMessage.class, s -> {
            MapMessage mm = s.createMapMessage();
            mm.setBoolean("b", true);
            mm.setByte("by", (byte) -3);
            mm.setBytes("bytes", new byte[] {1, 2, 3});
            mm.setChar("c", 'x');
            mm.setDouble("d", 2.5);
            mm.setFloat("f", 0.25f);
            mm.setInt("i", 42);
            mm.setLong("l", 10000000000L);
            mm.setString("s", "v \u2713");
            mm.setShort("sh", (short) -7);
            return mm;
        }, m -> {
            MapMessage mm = (MapMessage) m;
            Map<String, String> out = new TreeMap<>();
            Enumeration<?> names = mm.getMapNames();
            while (names.hasMoreElements()) {
                String k = (String) names.nextElement();
                out.put(k, typedValue(mm.getObject(k)));
            }
            return out;
        }, mapWant);
        List<String> streamWant = Arrays.asList("String:s \u2713", "Integer:7",
            "Long:-10000000000", "Boolean:false", "Double:3.75", "byte[]:[9, 8]",
            "Character:q", "Short:5", "null", "EOF");
        typeCheck("stream", StreamMessage.class, s -> {
            StreamMessage sm = s.createStreamMessage();
            sm.writeString("s \u2713");
            sm.writeInt(7);
            sm.writeLong(-10000000000L);
            sm.writeBoolean(false);
            sm.writeDouble(3.75);
            sm.writeBytes(new byte[] {9, 8});
            sm.writeChar('q');
            sm.writeShort((short) 5);
            sm.writeObject(null);
            return sm;
        }, m -> {
            StreamMessage sm = (StreamMessage) m;
            List<String> out = new ArrayList<>();
            for (int i = 0; i < 12; i++) {
                try {
                    out.add(typedValue(sm.readObject()));
                } catch (MessageEOFException eof) {
                    out.add("EOF");
                    break;
                }
            }
            return out;
        }, streamWant);
        Payload payload = new Payload("p \u2713", 17, Arrays.asList("a", "b"));
        typeCheck("object", ObjectMessage.class, s -> s.createObjectMessage(payload),
            m -> String.valueOf(((ObjectMessage) m).getObject()), payload.toString());
        typeCheck("message", Message.class, s -> s.createMessage(),
            m -> m instanceof TextMessage || m instanceof BytesMessage || m instanceof MapMessage
                || m instanceof StreamMessage || m instanceof ObjectMessage
                ? "subtype:" + m.getClass().getSimpleName() : "plain", "plain");
    }

    // ------------------------------------------------------------------ groups with selectors

    /**
     * Grouped messages on one queue with consumers on several connections (listeners):
     * every group must reach exactly one consumer, in order, and only a consumer whose
     * selector matches it.
     */
    void groupSelectorCheck(String check, String[] selectors, Map<String, Set<Integer>> allowed) {
        String q = queueName("group-selectors") + "." + check;
        check("group-selectors", check, r -> {
            final int perGroup = 5;
            String[] groups = {"g0", "g1", "g2", "g3"};
            String[] regions = {"east", "west", "east", "west"};
            int total = perGroup * groups.length;
            ConcurrentLinkedQueue<String> got = new ConcurrentLinkedQueue<>();
            ConcurrentLinkedQueue<String> errors = new ConcurrentLinkedQueue<>();
            CountDownLatch done = new CountDownLatch(total);
            List<Connection> conns = new ArrayList<>();
            try {
                for (int i = 0; i < selectors.length; i++) {
                    final int idx = i;
                    Connection c = connect();
                    conns.add(c);
                    Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
                    MessageConsumer mc = s.createConsumer(s.createQueue(q), selectors[i]);
                    mc.setMessageListener(m -> {
                        try {
                            got.add(idx + "|" + body(m));
                        } catch (Throwable t) {
                            errors.add(describe(t));
                        } finally {
                            done.countDown();
                        }
                    });
                }
                Connection pc = connect();
                conns.add(pc);
                Session ps = pc.createSession(false, Session.AUTO_ACKNOWLEDGE);
                MessageProducer p = ps.createProducer(ps.createQueue(q));
                for (int seq = 1; seq <= perGroup; seq++) {
                    for (int g = 0; g < groups.length; g++) {
                        TextMessage m = ps.createTextMessage(groups[g] + "-" + seq);
                        m.setStringProperty("JMSXGroupID", groups[g]);
                        m.setIntProperty("JMSXGroupSeq", seq);
                        m.setStringProperty("region", regions[g]);
                        p.send(m);
                    }
                }
                boolean complete = done.await(15, TimeUnit.SECONDS);
                Thread.sleep(QUIET_MS); // duplicates would arrive now
                Map<String, List<String>> byGroup = new TreeMap<>();
                Map<String, Set<Integer>> owners = new TreeMap<>();
                for (String x : got) {
                    int bar = x.indexOf('|');
                    int consumer = Integer.parseInt(x.substring(0, bar));
                    String b = x.substring(bar + 1);
                    String g = b.substring(0, b.indexOf('-'));
                    byGroup.computeIfAbsent(g, k -> new ArrayList<>()).add(b);
                    owners.computeIfAbsent(g, k -> new TreeSet<>()).add(consumer);
                }
                List<String> problems = new ArrayList<>();
                for (String g : groups) {
                    List<String> want = new ArrayList<>();
                    for (int seq = 1; seq <= perGroup; seq++) {
                        want.add(g + "-" + seq);
                    }
                    Set<Integer> who = owners.getOrDefault(g, Collections.emptySet());
                    if (!want.equals(byGroup.get(g))) {
                        problems.add(g + " received " + byGroup.get(g));
                    }
                    if (who.size() != 1) {
                        problems.add(g + " split over consumers " + who);
                    } else if (!allowed.get(g).containsAll(who)) {
                        problems.add(g + " went to consumer " + who + ", selector mismatch");
                    }
                }
                r.put("received", got.size());
                r.put("complete", complete);
                r.put("owners", owners);
                r.put("problems", problems);
                r.put("listenerErrors", new ArrayList<>(errors));
                return complete && got.size() == total && problems.isEmpty() && errors.isEmpty();
            } finally {
                for (Connection c : conns) {
                    closeQuietly(c);
                }
            }
        });
    }

    void groupSelectors() {
        Map<String, Set<Integer>> disjoint = new TreeMap<>();
        disjoint.put("g0", Collections.singleton(0));
        disjoint.put("g1", Collections.singleton(1));
        disjoint.put("g2", Collections.singleton(0));
        disjoint.put("g3", Collections.singleton(1));
        groupSelectorCheck("disjoint", new String[] {"region = 'east'", "region = 'west'"},
            disjoint);
        Map<String, Set<Integer>> mixed = new TreeMap<>();
        mixed.put("g0", new TreeSet<>(Arrays.asList(0, 1)));
        mixed.put("g1", Collections.singleton(1));
        mixed.put("g2", new TreeSet<>(Arrays.asList(0, 1)));
        mixed.put("g3", Collections.singleton(1));
        // consumer 0 takes only east, consumer 1 everything
        groupSelectorCheck("withPlainConsumer", new String[] {"region = 'east'", null}, mixed);
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
                        // non-ASCII escaped too: stdout's charset need not be UTF-8
                        if (ch < 0x20 || ch > 0x7e) {
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
