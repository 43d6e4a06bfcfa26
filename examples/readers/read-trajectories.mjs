// Read a JetRL run's finished trajectories from outside, as the read-only observer (Node, nats.js).
//
//   jetrl creds observer --run-dir runs/latest     # writes runs/latest/nats/observer.context.json
//   (cd examples/readers && npm ci)                # nats and @msgpack/msgpack (make setup-readers)
//   node examples/readers/read-trajectories.mjs runs/latest/nats/observer.context.json [--max N] [--idle-s S]
//
// Every trajectory on <prefix>.traj.> since the run began, then the new ones as they come (an ordered
// consumer). Payloads are msgpack maps; their fields are in docs/schemas/trajectory.json.
import { readFileSync } from "node:fs";
import { parseArgs } from "node:util";
import { connect } from "nats";
import { decode } from "@msgpack/msgpack";

const { values, positionals } = parseArgs({ allowPositionals: true,
  options: { max: { type: "string", default: "0" }, "idle-s": { type: "string", default: "0" } } });
const ctx = JSON.parse(readFileSync(positionals[0], "utf8"));
// the inbox prefix matters: the observer may subscribe only under it, and JetStream delivers to an inbox
const nc = await connect({ servers: ctx.url, user: ctx.user || undefined, pass: ctx.password || undefined,
  inboxPrefix: ctx.inbox_prefix });
const consumer = await nc.jetstream().consumers.get(ctx.jetrl_traj_stream, { filterSubjects: ctx.jetrl_traj_subject });
const max = Number(values.max), idleMs = Number(values["idle-s"]) * 1000;
let seen = 0;
while (!max || seen < max) {
  const msg = await consumer.next({ expires: idleMs || 30000 });
  if (!msg) { if (idleMs) break; else continue; }
  const t = decode(msg.data);
  seen += 1;
  console.log(`${t.task} ${t.episode_id} reward ${t.reward.toFixed(2)} ${t.status} turns ${t.turns.length}`);
}
await nc.close();
