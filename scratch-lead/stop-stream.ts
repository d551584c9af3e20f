import { Sandbox } from "e2b";
import { startTestKiln } from "../test/support/kiln.ts";
import { generateKeyIn } from "../src/keys/service.ts";
const k = await startTestKiln();
const key = (await k.kiln.services.keys.create("e2b-stop", generateKeyIn("e2b"))).key;
const opts = { apiKey: key, apiUrl: k.url, sandboxUrl: k.url, requestTimeoutMs: 30_000 };
const sbx = await Sandbox.create("base", opts);
const h = await sbx.commands.run("sleep 300", { background: true, timeoutMs: 0 });
const w = await sbx.files.watchDir("/tmp", () => {});
console.log("streams open");
const t0 = performance.now();
h.wait().catch((e) => console.log("wait ended:", String(e).slice(0, 100), Math.round(performance.now() - t0)));
const n = k.logs.length;
await k.stop();
console.log("close took", Math.round(performance.now() - t0), "ms");
for (const l of k.logs.slice(n)) { const j = JSON.parse(l); console.log(j.time - Math.round(performance.timeOrigin + t0), l.slice(0, 300)); }
const k2 = await startTestKiln({ dataDir: k.dataDir });
await k2.close();
process.exit(0);
