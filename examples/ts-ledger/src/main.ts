// A JetRL env replica in TypeScript: `node dist/main.js [--max-sessions=N] [--session-timeout-s=S]
// [--max-observation-chars=N] [--num-train-tasks=N] [--num-test-tasks=N]`, configured by the environment
// variables of docs/env-protocol.md, section 9 (JETRL_NATS_URL, JETRL_NATS_USER, JETRL_NATS_PASSWORD_FILE,
// JETRL_NATS_PREFIX, JETRL_TASK, JETRL_REPLICA_ID, JETRL_HEARTBEAT_TTL_S).
//
// Connect, serve the six endpoints as one micro service, heartbeat into the registry KV, and on SIGTERM stop
// taking sessions, let the calls under way end, close the rest and leave within 10 s.

import { readFileSync } from "node:fs";
import { hostname } from "node:os";
import { connect, type NatsConnection, type ServiceMsg } from "nats";

import { Host } from "./host.js";
import { TaskSet } from "./ledger.js";
import { checkToken, encodeMessage, MAX_MESSAGE_BYTES, PROTOCOL_VERSION, ProtocolError, Subjects } from "./protocol.js";

function log(event: string, fields: Record<string, unknown> = {}): void {
  process.stderr.write(JSON.stringify({ event, role: `env-${task}`, replica_id: replicaId, ...fields }) + "\n");
}

function flag(name: string, fallback: number): number {
  const given = process.argv.slice(2).find((a) => a.startsWith(`--${name}=`));
  if (given === undefined) return fallback;
  const value = Number(given.split("=", 2)[1]);
  if (!Number.isFinite(value) || value <= 0) throw new Error(`--${name} must be a positive number, got ${given}`);
  return value;
}

const unknownFlags = process.argv.slice(2).filter((a) =>
  !/^--(max-sessions|session-timeout-s|max-observation-chars|num-train-tasks|num-test-tasks)=/.test(a));
if (unknownFlags.length) throw new Error(`unknown arguments: ${unknownFlags.join(" ")}`);

const env = process.env;
const task = checkToken(env.JETRL_TASK || "ledger", "JETRL_TASK");
const prefix = checkToken(env.JETRL_NATS_PREFIX || "jetrl", "JETRL_NATS_PREFIX");
const replicaId = checkToken(env.JETRL_REPLICA_ID || `env-${task}-${hostname().split(".")[0]}-${process.pid}`
  .replace(/[^A-Za-z0-9_-]/g, "-"), "JETRL_REPLICA_ID");
const heartbeatTtlS = Number(env.JETRL_HEARTBEAT_TTL_S || "10");
const subjects = new Subjects(prefix, task);
const host = new Host({
  task, replicaId, maxSessions: flag("max-sessions", 64), sessionTimeoutS: flag("session-timeout-s", 600),
  maxObservationChars: flag("max-observation-chars", 800),
}, new TaskSet(flag("num-train-tasks", 96), flag("num-test-tasks", 48)));

async function open(): Promise<NatsConnection> {
  const user = env.JETRL_NATS_USER || undefined;
  const pass = env.JETRL_NATS_PASSWORD_FILE ? readFileSync(env.JETRL_NATS_PASSWORD_FILE, "utf8").trim() : undefined;
  return connect({
    servers: (env.JETRL_NATS_URL || "nats://127.0.0.1:4222").split(",").map((s) => s.trim()).filter(Boolean),
    name: replicaId, user, pass,
    inboxPrefix: user ? `_INBOX_${user}` : undefined,  // section 2: a role reads only its own replies
    waitOnFirstConnect: true, maxReconnectAttempts: -1, reconnectTimeWait: 1000,
  });
}

const inFlight = new Set<Promise<void>>();

/** One endpoint's handler: its reply, or the error headers (and a dead letter for a request we cannot read). */
function endpoint(nc: NatsConnection, handle: (data: Uint8Array) => Promise<Uint8Array>) {
  return (err: Error | null, msg: ServiceMsg): void => {
    if (err) {
      log("endpoint_error", { error: String(err) });
      return;
    }
    const work = (async () => {
      try {
        msg.respond(await handle(msg.data));
      } catch (exc) {
        const [code, reason] = exc instanceof ProtocolError ? [exc.code, exc.reason] : [500, String(exc)];
        if (code === 500) log("env_handler_failed", { subject: msg.subject, error: String(exc) });
        msg.respondError(code, reason.replace(/[\r\n]+/g, " "));  // a header value is one line
        if (code === 400 || code === 413) {
          log("dead_letter", { origin_subject: msg.subject, reason, size: msg.data.length });
          nc.publish(subjects.deadLetter(), encodeMessage("dead_letter", {
            origin_subject: msg.subject, reason, payload: msg.data.subarray(0, MAX_MESSAGE_BYTES / 2),
            service: `env-${task}`, ts: Date.now() / 1000 }));
        }
      }
    })();
    inFlight.add(work);
    void work.finally(() => inFlight.delete(work));
  };
}

async function main(): Promise<void> {
  const nc = await open();
  const service = await nc.services.add({
    name: subjects.serviceName(), version: PROTOCOL_VERSION, description: `JetRL ${task} environment (TypeScript)`,
    metadata: { replica_id: replicaId },
  });
  service.addEndpoint("start", { subject: subjects.start(), handler: endpoint(nc, (d) => host.start(d)) });
  service.addEndpoint("tasks", { subject: subjects.tasks(), handler: endpoint(nc, (d) => host.tasks(d)) });
  service.addEndpoint("health", { subject: subjects.health(), queue: `health-${replicaId}`,
                                  handler: endpoint(nc, () => host.health()) });
  service.addEndpoint("interact", { subject: subjects.interact(replicaId), handler: endpoint(nc, (d) => host.interact(d)) });
  service.addEndpoint("cancel", { subject: subjects.cancel(replicaId), handler: endpoint(nc, (d) => host.cancel(d)) });
  service.addEndpoint("oracle", { subject: subjects.oracle(replicaId), handler: endpoint(nc, (d) => host.oracle(d)) });

  const startedAt = Date.now() / 1000;
  const beat = () => nc.publish(subjects.registry(replicaId), encodeMessage("heartbeat", {
    role: `env-${task}`, replica_id: replicaId, pid: process.pid, host: hostname(), started_at: startedAt,
    info: { task, max_sessions: host.settings.maxSessions }, ts: Date.now() / 1000 }));
  beat();
  const heartbeats = setInterval(beat, Math.min(2000, (heartbeatTtlS * 1000) / 3));
  const reaper = setInterval(() => {
    const reaped = host.reapIdle();
    if (reaped) log("sessions_reaped", { sessions: reaped, status: "timeout" });
  }, Math.min(5000, (host.settings.sessionTimeoutS * 1000) / 2));
  void (async () => {
    for await (const status of nc.status()) {
      if (status.type === "error" || status.type === "disconnect" || status.type === "reconnect") {
        log(`nats_${status.type}`, { data: String(status.data) });
      }
    }
  })();
  log("env_ready", { task, prefix, train_tasks: host.taskSet.ids("train")?.length,
                     test_tasks: host.taskSet.ids("test")?.length });

  let stopping = false;
  const stop = async (signal: string) => {
    if (stopping) return;
    stopping = true;
    setTimeout(() => process.exit(1), 8000).unref();  // gone within 10 s, NATS or not
    log("env_stopping", { signal, open_sessions: host.sessions.size });
    host.stopping = true;  // new starts get 503 while the calls under way finish
    await Promise.race([Promise.allSettled([...inFlight]), new Promise((r) => setTimeout(r, 3000))]);
    const closed = host.closeAll();
    clearInterval(heartbeats);
    clearInterval(reaper);
    await service.stop();
    await nc.drain();
    log("env_host_stopped", { sessions_closed: closed });
    process.exit(0);
  };
  process.on("SIGTERM", () => void stop("SIGTERM"));
  process.on("SIGINT", () => void stop("SIGINT"));
  const closed = await nc.closed();  // only a connection closed for good ends up here without a signal
  if (!stopping) {
    log("nats_closed", { error: String(closed ?? "") });
    process.exit(1);
  }
}

main().catch((err) => {
  log("env_failed", { error: String(err) });
  process.exit(1);
});
