/*
 * Qpid JMS across a takeover of an amqbroker primary/backup pair
 * (tests/ha/test_pair_jms.py).
 *
 * Usage:
 *   java -cp <classes>:<qpid-jms classpath> amqbroker.interop.HaFailover \
 *        produce QUEUE COUNT GROUPS NAME=URI [NAME=URI ...]
 *   java ... amqbroker.interop.HaFailover consume QUEUE IDLE_MS URI
 *
 * produce: one thread and one connection per NAME=URI (a failover: URI), each sending
 * COUNT persistent text messages, synchronously (Qpid JMS waits for the broker's
 * disposition of a persistent send), to QUEUE; message i of producer NAME is in group
 * "NAME-g<i % GROUPS>" (JMSXGroupID) with JMSXGroupSeq 1, 2, 3... per group, and the
 * properties "producer" (NAME) and "n" (i). Prints on stdout, one line each:
 *   EVENT NAME established|interrupted|restored URI   (the connection's failover events)
 *   ACK NAME GROUP SEQ N                               (send() returned: acknowledged)
 *   DONE NAME
 *   ERROR NAME <exception>                             (exit status 2)
 *
 * consume: one connection to URI, AUTO_ACKNOWLEDGE, receives from QUEUE until nothing
 * arrives for IDLE_MS; prints "MSG GROUP SEQ PRODUCER N REDELIVERED" per message, then
 * "DONE <count>".
 */
package amqbroker.interop;

import jakarta.jms.Connection;
import jakarta.jms.DeliveryMode;
import jakarta.jms.JMSException;
import jakarta.jms.Message;
import jakarta.jms.MessageConsumer;
import jakarta.jms.MessageProducer;
import jakarta.jms.Queue;
import jakarta.jms.Session;
import jakarta.jms.TextMessage;

import org.apache.qpid.jms.JmsConnection;
import org.apache.qpid.jms.JmsConnectionFactory;
import org.apache.qpid.jms.JmsConnectionListener;
import org.apache.qpid.jms.message.JmsInboundMessageDispatch;

import java.net.URI;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.atomic.AtomicBoolean;

public final class HaFailover {
    private HaFailover() {
    }

    static synchronized void out(String line) {
        System.out.println(line);
        System.out.flush();
    }

    static final class Events implements JmsConnectionListener {
        private final String name;

        Events(String name) {
            this.name = name;
        }

        @Override
        public void onConnectionEstablished(URI uri) {
            out("EVENT " + name + " established " + uri);
        }

        @Override
        public void onConnectionFailure(Throwable error) {
            out("EVENT " + name + " failure " + String.valueOf(error).replace('\n', ' '));
        }

        @Override
        public void onConnectionInterrupted(URI uri) {
            out("EVENT " + name + " interrupted " + uri);
        }

        @Override
        public void onConnectionRestored(URI uri) {
            out("EVENT " + name + " restored " + uri);
        }

        @Override
        public void onInboundMessage(JmsInboundMessageDispatch envelope) {
        }

        @Override
        public void onSessionClosed(Session session, Throwable cause) {
        }

        @Override
        public void onConsumerClosed(MessageConsumer consumer, Throwable cause) {
        }

        @Override
        public void onProducerClosed(MessageProducer producer, Throwable cause) {
        }
    }

    static Connection connect(String name, String uri) throws JMSException {
        JmsConnection c = (JmsConnection) new JmsConnectionFactory(uri).createConnection();
        c.addConnectionListener(new Events(name));
        c.start();
        return c;
    }

    static void produce(String queue, int count, int groups, String name, String uri)
            throws JMSException {
        try (Connection c = connect(name, uri)) {
            Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
            Queue q = s.createQueue(queue);
            MessageProducer p = s.createProducer(q);
            p.setDeliveryMode(DeliveryMode.PERSISTENT);
            Map<String, Integer> seqs = new HashMap<>();
            for (int i = 0; i < count; i++) {
                String group = name + "-g" + (i % groups);
                int seq = seqs.merge(group, 1, Integer::sum);
                TextMessage m = s.createTextMessage(name + ":" + i);
                m.setStringProperty("JMSXGroupID", group);
                m.setIntProperty("JMSXGroupSeq", seq);
                m.setStringProperty("producer", name);
                m.setIntProperty("n", i);
                p.send(m);
                out("ACK " + name + " " + group + " " + seq + " " + i);
            }
        }
        out("DONE " + name);
    }

    static void consume(String queue, long idleMs, String uri) throws JMSException {
        int count = 0;
        try (Connection c = connect("consumer", uri)) {
            Session s = c.createSession(false, Session.AUTO_ACKNOWLEDGE);
            MessageConsumer consumer = s.createConsumer(s.createQueue(queue));
            while (true) {
                Message m = consumer.receive(idleMs);
                if (m == null) {
                    break;
                }
                count++;
                out("MSG " + m.getStringProperty("JMSXGroupID") + " "
                        + m.getIntProperty("JMSXGroupSeq") + " " + m.getStringProperty("producer")
                        + " " + m.getIntProperty("n") + " " + m.getJMSRedelivered());
            }
        }
        out("DONE " + count);
    }

    public static void main(String[] args) throws Exception {
        if (args.length >= 5 && args[0].equals("produce")) {
            String queue = args[1];
            int count = Integer.parseInt(args[2]);
            int groups = Integer.parseInt(args[3]);
            List<Thread> threads = new ArrayList<>();
            AtomicBoolean failed = new AtomicBoolean();
            for (int k = 4; k < args.length; k++) {
                int eq = args[k].indexOf('=');
                String name = args[k].substring(0, eq);
                String uri = args[k].substring(eq + 1);
                Thread t = new Thread(() -> {
                    try {
                        produce(queue, count, groups, name, uri);
                    } catch (Exception e) {
                        failed.set(true);
                        out("ERROR " + name + " " + String.valueOf(e).replace('\n', ' '));
                        e.printStackTrace();
                    }
                }, "producer-" + name);
                t.start();
                threads.add(t);
            }
            for (Thread t : threads) {
                t.join();
            }
            System.exit(failed.get() ? 2 : 0);
        } else if (args.length == 4 && args[0].equals("consume")) {
            try {
                consume(args[1], Long.parseLong(args[2]), args[3]);
            } catch (Exception e) {
                out("ERROR consumer " + String.valueOf(e).replace('\n', ' '));
                e.printStackTrace();
                System.exit(2);
            }
            System.exit(0);
        } else {
            System.err.println("usage: HaFailover produce QUEUE COUNT GROUPS NAME=URI...\n"
                    + "       HaFailover consume QUEUE IDLE_MS URI");
            System.exit(64);
        }
    }
}
