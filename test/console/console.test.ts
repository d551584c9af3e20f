// The web console (/console) in real headless Chromium against a real server: signing in with a key, a machine
// made through the API in the list, its terminal answering `echo hi`, its snapshots taken, used and deleted, a
// build's log followed live, a dead letter retried and a delivery replayed, and a host drained and activated — with no page errors, and the key never in a URL, a cookie or the server's logs.

import { after, before, describe, it } from "node:test";
import assert from "node:assert/strict";
import { access } from "node:fs/promises";
import { join } from "node:path";
import { randomBytes } from "node:crypto";
import { request } from "undici";
import WebSocket from "ws";
import type { Browser } from "puppeteer-core";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { startReceiver } from "../webhooks/receiver.ts";
import type { Receiver } from "../webhooks/receiver.ts";
import { launchBrowser, watchedPage } from "../support/browser.ts";
import type { WatchedPage } from "../support/browser.ts";
import { buildConsole, CONSOLE_DIST_DIR } from "../../src/console/bundle.ts";
import { build } from "../builds/support.ts";

const WAIT = { timeout: 60_000 };
// Functions handed to the page run in Chromium; the project's types are Node's (no DOM lib), so these are untyped.
declare const document: any, sessionStorage: any, localStorage: any, location: any;

describe("the web console", () => {
  let k: TestKiln;
  let browser: Browser;
  let w: WatchedPage;
  let receiver: Receiver;

  before(async () => {
    // The test command builds the console; a file run on its own builds it when it is missing.
    await access(join(CONSOLE_DIST_DIR, "index.html")).catch(() => buildConsole());
    receiver = await startReceiver();
    // One attempt per delivery, so a receiver error is a dead letter at once; loopback receivers allowed.
    k = await startTestKiln({ env: { KILN_WEBHOOK_RETRY_SCHEDULE_MS: "0", KILN_WEBHOOK_ALLOW_PRIVATE: "1", KILN_WARM_POOL: "1" } });
    browser = await launchBrowser();
    w = await watchedPage(browser);
  });

  after(async () => {
    await browser?.close();
    await k?.close();
    await receiver?.close();
  });

  it("is served without a key, under a strict Content-Security-Policy with a fresh style nonce per page", async () => {
    const first = await request(`${k.url}/console/`);
    const html = await first.body.text();
    assert.equal(first.statusCode, 200);
    assert.match(String(first.headers["content-type"]), /^text\/html/);
    const csp = String(first.headers["content-security-policy"]);
    assert.match(csp, /default-src 'none'/);
    assert.match(csp, /script-src 'self'(;|$)/);
    assert.match(csp, /connect-src 'self'/);
    assert.match(csp, /frame-ancestors 'none'/);
    const nonce = /'nonce-([^']+)'/.exec(csp)?.[1];
    assert.ok(nonce && html.includes(`nonce="${nonce}"`), "the page's style element carries the response's nonce");
    const second = await request(`${k.url}/console/`);
    await second.body.text();
    assert.notEqual(/'nonce-([^']+)'/.exec(String(second.headers["content-security-policy"]))?.[1], nonce, "a nonce is never reused");
    assert.equal(first.headers["x-content-type-options"], "nosniff");
    assert.equal(first.headers["referrer-policy"], "no-referrer");

    const bare = await request(`${k.url}/console`);
    assert.equal(bare.statusCode, 200);
    assert.match(await bare.body.text(), /<div id="app">/);

    const script = /src="(\/console\/assets\/[^"]+\.js)"/.exec(html)?.[1];
    assert.ok(script, html);
    const asset = await request(`${k.url}${script}`);
    await asset.body.text();
    assert.equal(asset.statusCode, 200);
    assert.match(String(asset.headers["content-type"]), /javascript/);
    assert.match(String(asset.headers["cache-control"]), /immutable/);

    // Nothing outside the built assets is reachable through them, and the API behind stays closed.
    for (const path of ["/console/assets/../../../package.json", "/console/assets/..%2f..%2fpackage.json", "/console/assets/%2e%2e/index.html", "/console/assets/missing.js"]) {
      const res = await request(`${k.url}${path}`);
      const text = await res.body.text();
      // 401: the path left /console/assets/ once normalised, and an unknown path needs a key like any API route.
      assert.ok([401, 403, 404].includes(res.statusCode), `${path} answered ${res.statusCode}`);
      assert.doesNotMatch(text, /"name": "kiln"/);
    }
    assert.equal((await k.call("GET", "/v1/machines", { key: null })).status, 401);
  });

  it("lets a browser open the machine WebSocket with its key in a subprotocol, and never echoes that subprotocol", async () => {
    const m = await k.call("POST", "/v1/machines", { body: { timeout_s: 300 } });
    assert.equal(m.status, 201, m.text);
    const url = `${k.url.replace("http", "ws")}/v1/machines/${m.body.id}/ws`;
    const bearer = (key: string) => `kiln.bearer.${Buffer.from(key).toString("base64url")}`;
    const refused = await new Promise<number>((resolve) => {
      const ws = new WebSocket(url, ["kiln.v1", bearer("kiln_wrong_key_0123456789abcdefghijkl")]);
      ws.on("unexpected-response", (_req, res) => resolve(res.statusCode ?? 0));
      ws.on("open", () => resolve(101));
      ws.on("error", () => undefined);
    });
    assert.equal(refused, 401);
    const ws = new WebSocket(url, ["kiln.v1", bearer(TEST_KEY)]);
    await new Promise((resolve, reject) => (ws.once("open", resolve), ws.once("error", reject)));
    assert.equal(ws.protocol, "kiln.v1");
    const exit = new Promise<any>((resolve) => ws.on("message", (d) => JSON.parse(String(d)).type === "exec.exit" && resolve(JSON.parse(String(d)))));
    ws.send(JSON.stringify({ type: "exec.start", request_id: "r", cmd: "true" }));
    assert.equal((await exit).exit_code, 0);
    ws.close();
    await k.call("DELETE", `/v1/machines/${m.body.id}`);
  });

  it("signs in with a key kept in the tab only, and refuses a wrong one", async () => {
    const { page } = w;
    await page.goto(`${k.url}/console/`);
    await page.waitForSelector("#api-key", WAIT);
    await page.type("#api-key", "kiln_not_a_key_0123456789abcdefghijk");
    await page.keyboard.press("Enter");
    await page.waitForFunction(() => document.querySelector(".error")?.textContent?.includes("refused"), WAIT);
    // Chromium reports the refused check (401) in the console: that one is expected, nothing else is.
    assert.equal(w.problems.length, 1, w.problems.join("\n"));
    assert.match(w.problems[0], /status of 401/);
    w.problems.length = 0;
    await page.$eval("#api-key", (el: any) => (el.value = ""));
    await page.type("#api-key", TEST_KEY);
    await page.keyboard.press("Enter");
    await page.waitForSelector("nav.top", WAIT);
    assert.equal(await page.evaluate(() => sessionStorage.getItem("kiln.apiKey")), TEST_KEY);
    assert.equal(await page.evaluate(() => localStorage.length), 0);
    assert.deepEqual(await page.cookies(), []);
    await w.screenshot("signed-in");
  });

  it("lists a machine made through the API with its status and template", async () => {
    const m = await k.call("POST", "/v1/machines", { body: { name: "console-test", timeout_s: 600 } });
    assert.equal(m.status, 201, m.text);
    const { page } = w;
    await page.goto(`${k.url}/console/#/machines`);
    await page.waitForSelector(`tr[data-machine="${m.body.id}"]`, WAIT);
    const row = await page.$eval(`tr[data-machine="${m.body.id}"]`, (el) => el.textContent ?? "");
    assert.match(row, /console-test/);
    assert.match(row, /running/);
    assert.match(row, /local\/base/);
    await w.screenshot("machines");

    // Its terminal: the page opens a PTY over the machine WebSocket, and typed keys reach the shell.
    await page.click(`tr[data-machine="${m.body.id}"] a`);
    await page.waitForFunction(() => document.querySelector("[data-terminal-status]")?.textContent === "connected", WAIT);
    await page.waitForSelector(".xterm-helper-textarea", WAIT);
    await page.focus(".xterm-helper-textarea");
    await page.keyboard.type("echo h''i\n");
    // The command line shows `echo h''i`; only the shell's answer is a line that is exactly `hi`.
    await page.waitForFunction(() => [...document.querySelectorAll(".xterm-rows > div")].some((row: any) => row.textContent?.trim() === "hi"), WAIT);
    await w.screenshot("terminal");
  });

  it("shows a machine's snapshots: takes one, starts a machine from it, deletes it", async () => {
    const m = await k.call("POST", "/v1/machines", { body: { timeout_s: 600 } });
    assert.equal(m.status, 201, m.text);
    const made = [m.body.id as string];
    try {
      const put = await k.call("PUT", `/v1/machines/${m.body.id}/files?path=/workspace/kept.txt`, { raw: "kept by the snapshot\n", headers: { "content-type": "application/octet-stream" } });
      assert.equal(put.status, 200, put.text);
      const { page } = w;
      await page.goto(`${k.url}/console/#/machines/${m.body.id}/snapshots`);
      await page.waitForSelector("form[aria-label='Take a snapshot'] input", WAIT);
      await page.waitForFunction(() => document.querySelector("main")?.textContent?.includes("No snapshots of this machine"), WAIT);
      await page.type("form[aria-label='Take a snapshot'] input", "from-the-console");
      await page.click("form[aria-label='Take a snapshot'] button[type=submit]");
      await page.waitForSelector("tr[data-snapshot]", WAIT);
      const listed = (await k.call("GET", `/v1/snapshots?machine_id=${m.body.id}`)).body.snapshots;
      assert.equal(listed.length, 1);
      assert.equal(listed[0].name, "from-the-console");
      const snapshotId = listed[0].id as string;
      const row = await page.$eval(`tr[data-snapshot="${snapshotId}"]`, (el) => el.textContent ?? "");
      assert.match(row, /from-the-console/);
      assert.match(row, /ready/);
      await w.screenshot("snapshots");

      // A new machine from it: the console goes to that machine, which has the file.
      await page.click(`tr[data-snapshot="${snapshotId}"] button:not(.danger)`);
      await page.waitForFunction((parent: string) => /^#\/machines\/mch_/.test(location.hash) && !location.hash.includes(parent), WAIT, m.body.id);
      const childId = (await page.evaluate(() => location.hash)).split("/")[2];
      made.push(childId);
      const child = await k.call("GET", `/v1/machines/${childId}`);
      assert.equal(child.body.snapshot_id, snapshotId);
      const read = await k.call("GET", `/v1/machines/${childId}/files?path=/workspace/kept.txt`);
      assert.equal(read.text, "kept by the snapshot\n");

      // Delete (confirmed by a second press).
      await page.goto(`${k.url}/console/#/machines/${m.body.id}/snapshots`);
      const del = `tr[data-snapshot="${snapshotId}"] button.danger`;
      await page.waitForSelector(del, WAIT);
      await page.click(del);
      await page.waitForSelector(`${del}.armed`, WAIT);
      await page.click(del);
      await page.waitForFunction(() => document.querySelector("main")?.textContent?.includes("No snapshots of this machine"), WAIT);
      assert.equal((await k.call("GET", `/v1/snapshots/${snapshotId}`)).body.status, "deleted");
    } finally {
      for (const id of made) await k.call("DELETE", `/v1/machines/${id}`);
    }
  });

  it("follows a build's log live, while the build is still running", async () => {
    const marker = randomBytes(4).toString("hex");
    // Eight lines a second apart: the page must show the first ones before the last is printed.
    const started = await build(
      k,
      { name: `console-${marker}`, steps: [{ type: "run", command: `for i in 1 2 3 4 5 6 7 8; do echo tick-${marker}-$i; sleep 1; done` }] },
      { stopAfter: (e) => e.event === "start" },
    );
    assert.equal(started.status, 200, started.raw);
    const { build_id: buildId, template_id: templateId } = started.events[0].data;
    const { page } = w;
    await page.goto(`${k.url}/console/#/templates/${templateId}/builds/${buildId}`);
    await page.waitForFunction((m: string) => document.querySelector("[role=log]")?.textContent?.includes(`tick-${m}-2`), WAIT, marker);
    const record = await k.call("GET", `/v1/templates/${templateId}/builds/${buildId}`);
    assert.equal(record.body.status, "building", "the page showed the log while the build ran");
    const shownThen = await page.$eval("[role=log]", (el) => el.textContent ?? "");
    assert.doesNotMatch(shownThen, new RegExp(`tick-${marker}-8`));
    await page.waitForFunction(() => document.querySelector("[data-log-state]")?.textContent === "log complete", { timeout: 180_000 });
    const log = await page.$eval("[role=log]", (el) => el.textContent ?? "");
    for (let i = 1; i <= 8; i++) assert.match(log, new RegExp(`tick-${marker}-${i}`));
    assert.equal((await k.call("GET", `/v1/templates/${templateId}/builds/${buildId}`)).body.status, "ready");
    await w.screenshot("build-log");
  });

  it("retries a dead-letter webhook delivery", async () => {
    receiver.respond = () => ({ status: 500, body: "down" });
    const hook = await k.call("POST", "/v1/lifecycle/webhooks", { body: { url: `${receiver.url}/hook`, operations: ["create"], signing_secret: `whsec_${randomBytes(24).toString("base64")}` } });
    assert.equal(hook.status, 201, hook.text);
    const m = await k.call("POST", "/v1/machines", { body: { timeout_s: 300 } });
    assert.equal(m.status, 201, m.text);
    await receiver.waitFor((r) => r.path === "/hook");
    let delivery: any;
    for (let i = 0; i < 200 && delivery?.status !== "dead_letter"; i++) {
      delivery = (await k.call("GET", `/v1/lifecycle/webhooks/${hook.body.id}/deliveries`)).body.deliveries[0];
      if (delivery?.status !== "dead_letter") await new Promise((r) => setTimeout(r, 100));
    }
    assert.equal(delivery?.status, "dead_letter");

    receiver.respond = () => ({ status: 200, body: "ok" });
    const { page } = w;
    await page.goto(`${k.url}/console/#/webhooks/${hook.body.id}`);
    const retry = `tr[data-delivery="${delivery.id}"] button`;
    await page.waitForSelector(retry, WAIT);
    await w.screenshot("dead-letter");
    await page.click(retry);
    await receiver.waitForCount((r) => r.path === "/hook", 2);
    await page.waitForFunction((id: string) => document.querySelector(`tr[data-delivery="${id}"]`)?.textContent?.includes("succeeded"), WAIT, delivery.id);
    assert.equal((await k.call("GET", `/v1/lifecycle/webhooks/${hook.body.id}/deliveries/${delivery.id}`)).body.status, "succeeded");
    await w.screenshot("retried");

    // Replay the delivery that succeeded: the receiver gets the same event again as a new delivery.
    await page.click(`button[data-replay="${delivery.id}"]`);
    const [, , third] = await receiver.waitForCount((r) => r.path === "/hook", 3);
    const replayId = String(third.headers["x-service-delivery-id"]);
    assert.notEqual(replayId, delivery.id);
    assert.equal(third.headers["x-service-event-id"], delivery.event_id);
    await page.waitForFunction((id: string) => document.querySelector(`tr[data-delivery="${id}"]`)?.textContent?.includes("succeeded"), WAIT, replayId);
    assert.match(await page.$eval("[role=status]", (el) => el.textContent ?? ""), new RegExp(`Replayed ${delivery.id} as ${replayId}`));
    assert.equal((await k.call("GET", `/v1/lifecycle/webhooks/${hook.body.id}/deliveries/${delivery.id}`)).body.attempts.length, 2, "the original is unchanged");
    await w.screenshot("replayed");
    await k.call("DELETE", `/v1/lifecycle/webhooks/${hook.body.id}`);
    await k.call("DELETE", `/v1/machines/${m.body.id}`);
  });

  it("drains a host after a confirmation and activates it again, the row following each answer; a refusal shows as an error", async () => {
    const self = (await k.call("GET", "/v1/hosts")).body.hosts.find((h: { self: boolean }) => h.self);
    assert.equal(self?.status, "active");
    const row = `tr[data-host="${self.id}"]`;
    const { page } = w;
    const other = await k.call("POST", "/v1/keys", { body: { name: "console-not-operator" } });
    assert.equal(other.status, 201, other.text);
    try {
      await page.goto(`${k.url}/console/#/hosts`);
      await page.waitForSelector(`${row} button.danger`, WAIT);
      // The first press only asks; the host is still active.
      await page.click(`${row} button.danger`);
      await page.waitForSelector(`${row} button.danger.armed`, WAIT);
      assert.match(await page.$eval(`${row} button.danger`, (el) => el.textContent ?? ""), /Really drain/);
      assert.equal((await k.call("GET", `/v1/hosts/${self.id}`)).body.status, "active");
      await page.click(`${row} button.danger`);
      await page.waitForFunction((sel: string) => document.querySelector(`${sel} .status`)?.textContent === "draining", WAIT, row);
      assert.equal((await k.call("GET", `/v1/hosts/${self.id}`)).body.status, "draining");
      await w.screenshot("host-draining");

      await page.waitForSelector(`${row} button:not(.danger)`, WAIT);
      assert.equal(await page.$eval(`${row} button:not(.danger)`, (el) => el.textContent), "Activate");
      await page.click(`${row} button:not(.danger)`);
      await page.waitForFunction((sel: string) => document.querySelector(`${sel} .status`)?.textContent === "active", WAIT, row);
      assert.equal((await k.call("GET", `/v1/hosts/${self.id}`)).body.status, "active");

      // A key that is not the operator's: the server's 403 shows beside the button, and nothing changes.
      await page.evaluate((key: string) => sessionStorage.setItem("kiln.apiKey", key), other.body.key);
      await page.reload();
      await page.waitForSelector(`${row} button.danger`, WAIT);
      await page.click(`${row} button.danger`);
      await page.waitForSelector(`${row} button.danger.armed`, WAIT);
      await page.click(`${row} button.danger`);
      await page.waitForFunction((sel: string) => document.querySelector(`${sel} [role=alert]`)?.textContent?.includes("operator's key"), WAIT, row);
      assert.match(await page.$eval(`${row} [role=alert]`, (el) => el.textContent ?? ""), /\(forbidden, req_/);
      assert.equal(await page.$eval(`${row} .status`, (el) => el.textContent), "active");
      assert.equal((await k.call("GET", `/v1/hosts/${self.id}`)).body.status, "active");
      await w.screenshot("host-drain-refused");
      // Chromium reports the refused call (403) in the console: that one is expected, nothing else is.
      assert.equal(w.problems.length, 1, w.problems.join("\n"));
      assert.match(w.problems[0], /status of 403/);
      w.problems.length = 0;
    } finally {
      await page.evaluate((key: string) => sessionStorage.setItem("kiln.apiKey", key), TEST_KEY);
      await k.call("POST", `/v1/hosts/${self.id}/activate`);
      await k.call("DELETE", `/v1/keys/${other.body.id}`);
    }
  });

  it("went through every view with no page error, and the key never left the Authorization header", async () => {
    const { page } = w;
    for (const view of ["templates", "volumes", "deployments", "webhooks", "hosts"]) {
      await page.goto(`${k.url}/console/#/${view}`);
      await page.waitForSelector("main section", WAIT);
      await page.waitForNetworkIdle({ idleTime: 200, timeout: 30_000 });
      await w.screenshot(view);
    }
    assert.deepEqual(w.problems, []);
    const encoded = Buffer.from(TEST_KEY).toString("base64url");
    for (const url of w.urls) {
      assert.ok(!url.includes(TEST_KEY) && !url.includes(encoded), `the key is in ${url}`);
    }
    assert.ok(w.urls.some((u) => u.startsWith("ws://") && u.includes("/ws")), "the terminal used the machine WebSocket");
    const logs = k.logs.join("");
    assert.ok(!logs.includes(TEST_KEY) && !logs.includes(encoded), "the key is in the server's logs");
  });
});
