// Attacks on the web console (/console, docs/console.md) in real headless Chromium, by the parties that put text in
// front of it: a key holder (machine, volume and webhook names, machine metadata), machine root (file names, terminal
// output with HTML and escape sequences), a Dockerfile author (build log lines), a webhook receiver (its answers).
// Whatever they write is shown as text: no element of theirs appears in the page, nothing runs, the CSP reports
// nothing; the page cannot be framed; the key stays out of URLs, the logs and the store.

import { after, before, describe, it } from "node:test";
import assert from "node:assert/strict";
import { access, readdir, readFile, stat } from "node:fs/promises";
import { join } from "node:path";
import { randomBytes } from "node:crypto";
import { request } from "undici";
import type { Browser } from "puppeteer-core";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { startReceiver } from "../webhooks/receiver.ts";
import type { Receiver } from "../webhooks/receiver.ts";
import { launchBrowser, watchedPage } from "../support/browser.ts";
import type { WatchedPage } from "../support/browser.ts";
import { buildConsole, CONSOLE_DIST_DIR } from "../../src/console/bundle.ts";
import { buildOk } from "../builds/support.ts";

const WAIT = { timeout: 60_000 };
declare const document: any, window: any, location: any;

const MARK = randomBytes(4).toString("hex");
/** Markup that would leave elements (and a flag, were a handler to run) if it were ever parsed as HTML. */
const evil = (where: string) => `<img id="xss-${where}-${MARK}" src=x onerror="window.__pwned='${where}'"><b id="xssb-${where}-${MARK}">${where}</b>`;

describe("the web console under hostile content", () => {
  let k: TestKiln;
  let browser: Browser;
  let w: WatchedPage;
  let receiver: Receiver;
  let machineId: string;
  let hookId: string;
  let build: { templateId: string; buildId: string };
  /** The hostile names the API took (a name it refuses is no attack on the console). */
  const taken: string[] = [];

  before(async () => {
    await access(join(CONSOLE_DIST_DIR, "index.html")).catch(() => buildConsole());
    receiver = await startReceiver();
    // The receiver answers every delivery with HTML of its own: it becomes a dead letter at once.
    receiver.respond = () => ({ status: 500, headers: { "content-type": "text/html" }, body: evil("receiver") });
    k = await startTestKiln({ env: { KILN_WEBHOOK_RETRY_SCHEDULE_MS: "0", KILN_WEBHOOK_ALLOW_PRIVATE: "1" } });
    const hook = await k.call("POST", "/v1/lifecycle/webhooks", { body: { url: `${receiver.url}/hook?${encodeURIComponent(evil("hookurl"))}`, operations: ["create"], signing_secret: `whsec_${randomBytes(24).toString("base64")}` } });
    assert.equal(hook.status, 201, hook.text);
    hookId = hook.body.id;
    const named = await k.call("POST", "/v1/machines", { body: { name: evil("machinename"), metadata: { note: evil("metadata") }, timeout_s: 600 } });
    // A name the API refuses is no attack on the console; the metadata then carries the markup.
    const m = named.status === 201 ? named : await k.call("POST", "/v1/machines", { body: { metadata: { note: evil("metadata") }, timeout_s: 600 } });
    assert.equal(m.status, 201, m.text);
    if (named.status === 201) taken.push("machinename");
    machineId = m.body.id;
    // Machine root names a file with markup and escape sequences.
    const file = await k.call("POST", `/v1/machines/${machineId}/exec`, { body: { cmd: `cd /workspace && touch "$(printf '\\033[31m${evil("filename").replaceAll("/", "_")}\\007')"` } });
    assert.equal(file.status, 200, file.text);
    assert.equal(file.body.exit_code, 0, file.text);
    if ((await k.call("POST", "/v1/volumes", { body: { name: evil("volumename") } })).status === 201) taken.push("volumename");
    // A Dockerfile author's RUN prints markup and ANSI (colours, a title, an OSC 8 link to javascript:).
    const line = evil("buildlog").replaceAll("'", "");
    const b = await buildOk(k, { name: `xss-${MARK}`, steps: [{ type: "run", command: `printf '\\033[31m%s\\033[0m \\033]0;title\\007 \\033]8;;javascript:alert(1)\\033\\\\link\\033]8;;\\033\\\\\\n' '${line}'` }] });
    build = { templateId: b.end.template_id ?? b.events[0].data.template_id, buildId: b.buildId };
    await receiver.waitFor((r) => r.path.startsWith("/hook"));
    for (let i = 0; i < 200; i++) {
      const d = (await k.call("GET", `/v1/lifecycle/webhooks/${hookId}/deliveries`)).body.deliveries[0];
      if (d?.status === "dead_letter") break;
      await new Promise((r) => setTimeout(r, 50));
    }
    browser = await launchBrowser();
    w = await watchedPage(browser);
    await w.page.goto(`${k.url}/console/`);
    await w.page.waitForSelector("#api-key", WAIT);
    await w.page.type("#api-key", TEST_KEY);
    await w.page.keyboard.press("Enter");
    await w.page.waitForSelector("nav.top", WAIT);
  });

  after(async () => {
    await browser?.close();
    await k?.call("DELETE", `/v1/machines/${machineId}`).catch(() => undefined);
    await k?.close();
    await receiver?.close();
  });

  /** Opens a view, waits for `where`'s markup to be on screen as text, and checks none of it became page content. */
  async function shownAsText(hash: string, where: string[]) {
    const { page } = w;
    await page.goto(`${k.url}/console/#/${hash}`);
    for (const x of where) await page.waitForFunction((id: string) => document.body.innerText.includes(id), WAIT, `xss-${x}-${MARK}`);
    const injected = await page.evaluate(() => [...document.querySelectorAll('[id^="xss"], iframe, object, embed, script:not([src])')].map((e: any) => e.outerHTML));
    assert.deepEqual(injected, [], `${hash}: elements from hostile text`);
    assert.equal(await page.evaluate(() => window.__pwned), undefined);
    await w.screenshot(`hostile-${hash.replaceAll("/", "-").slice(0, 40)}`);
  }

  it("shows machine names and metadata, file names, volume names as text", async () => {
    await shownAsText("machines", taken.filter((t) => t === "machinename"));
    await shownAsText(`machines/${machineId}`, taken.filter((t) => t === "machinename"));
    await shownAsText(`machines/${machineId}/files`, ["filename"]);
    await shownAsText("volumes", taken.filter((t) => t === "volumename"));
    console.log("hostile names the API took:", taken.join(", ") || "none");
  });

  it("shows a webhook's URL and a receiver's answers as text", async () => {
    await shownAsText("webhooks", ["hookurl"]);
    await shownAsText(`webhooks/${hookId}`, ["hookurl"]);
  });

  it("shows a build's log lines (markup, ANSI, OSC links) as text", async () => {
    await shownAsText(`templates/${build.templateId}/builds/${build.buildId}`, ["buildlog"]);
    assert.equal(await w.page.evaluate(() => document.querySelectorAll('a[href^="javascript:"]').length), 0);
  });

  it("prints terminal output with markup and escape sequences as characters, never as links or elements", async () => {
    const { page } = w;
    await page.goto(`${k.url}/console/#/machines/${machineId}`);
    await page.waitForFunction(() => document.querySelector("[data-terminal-status]")?.textContent === "connected", WAIT);
    await page.waitForSelector(".xterm-helper-textarea", WAIT);
    await page.focus(".xterm-helper-textarea");
    // Built by the shell from octal escapes, so the echoed command line itself holds no markup.
    await page.keyboard.type(`printf '\\074b id=xss-term-${MARK}\\076\\033]8;;javascript:window.__pwned=1\\033\\134click\\033]8;;\\033\\134\\033]52;c;aGk=\\007 done-${MARK}\\n'\n`);
    await page.waitForFunction((m: string) => [...document.querySelectorAll(".xterm-rows > div")].some((row: any) => row.textContent?.includes(`done-${m}`)), WAIT, MARK);
    assert.equal(await page.evaluate(() => document.querySelectorAll('[id^="xss"], a[href^="javascript:"]').length), 0);
    assert.equal(await page.evaluate(() => window.__pwned), undefined);
  });

  it("cannot be framed, and neither its page nor the API's answers are cached", async () => {
    const framer = await browser.newPage();
    try {
      await framer.setContent(`<iframe id="f" src="${k.url}/console/"></iframe>`);
      await framer.waitForFunction(() => document.querySelector("#f") !== null, WAIT);
      await new Promise<void>((resolve) => framer.waitForNetworkIdle({ idleTime: 300, timeout: 10_000 }).then(() => resolve(), () => resolve()));
      const child = framer.frames().find((f) => f !== framer.mainFrame());
      // Blocked by frame-ancestors 'none': the frame holds Chromium's error page, never the console.
      const hasApp = child ? await child.evaluate(() => document.querySelector("#app") !== null).catch(() => false) : false;
      assert.equal(hasApp, false, "the console loaded inside another page's frame");
    } finally {
      await framer.close();
    }
    const res = await request(`${k.url}/console/`);
    await res.body.dump();
    assert.equal(res.headers["cache-control"], "no-store");
    assert.equal(res.headers["x-frame-options"], "DENY");
    // The API's answers (what the page shows) are not kept by a browser or a shared cache either.
    const api = await request(`${k.url}/v1/machines`, { headers: { authorization: `Bearer ${TEST_KEY}` } });
    await api.body.dump();
    assert.match(String(api.headers["cache-control"] ?? ""), /no-store/, `GET /v1/machines cache-control: ${api.headers["cache-control"]}`);
  });

  it("reported no page error or CSP violation, and the key reached no URL, log line or store file", async () => {
    assert.deepEqual(w.problems, []);
    const encoded = Buffer.from(TEST_KEY).toString("base64url");
    for (const url of w.urls) assert.ok(!url.includes(TEST_KEY) && !url.includes(encoded), `the key is in ${url}`);
    assert.ok(!k.logs.join("").includes(TEST_KEY), "the key is in the server's logs");
    // The store (SQLite here) and every small file in the data dir.
    const walk = async (dir: string): Promise<string[]> => {
      const out: string[] = [];
      for (const e of await readdir(dir, { withFileTypes: true }).catch(() => [])) {
        const p = join(dir, e.name);
        if (e.isDirectory() && !["machines", "layers", "artifacts", "volumes"].includes(e.name)) out.push(...(await walk(p)));
        else if (e.isFile() && (await stat(p)).size < 64 * 1024 * 1024) out.push(p);
      }
      return out;
    };
    for (const file of await walk(k.dataDir)) {
      const bytes = await readFile(file).catch(() => Buffer.alloc(0));
      assert.ok(!bytes.includes(TEST_KEY) && !bytes.includes(encoded), `the key is in ${file}`);
    }
  });
});
