// A deployment's pages never share the console's browser origin, nor each other's (docs/security/edge.md). Real
// headless Chromium, real deployments: a hostile page (a `public` site showing what its author likes) tries what an
// attacker would — the console's API key in sessionStorage after the user followed its link in the console's tab,
// another deployment's page read with the visitor's cookie (fetch, frame), a service worker over Kiln's whole origin,
// cookies planted on Kiln's origin (a cookie bomb) and on the other deployment (a decoy edge cookie) — on the path
// form (`/edge/<id>/` on the API's origin: sandboxed, an opaque origin) and on the host form (KILN_EDGE_DOMAIN: an
// origin per deployment). A normal page keeps working in both.

import { after, before, describe, it } from "node:test";
import assert from "node:assert/strict";
import { access } from "node:fs/promises";
import { join } from "node:path";
import { randomBytes } from "node:crypto";
import { request } from "undici";
import { WebSocket } from "ws";
import type { Browser, Page } from "puppeteer-core";
import { startTestKiln, TEST_KEY } from "../support/kiln.ts";
import type { TestKiln } from "../support/kiln.ts";
import { launchBrowser } from "../support/browser.ts";
import { buildConsole, CONSOLE_DIST_DIR } from "../../src/console/bundle.ts";
import { appCommand, createDeployment, services, waitService } from "./support.ts";

const WAIT = { timeout: 60_000 };
// Functions handed to the page run in Chromium; the project's types are Node's (no DOM lib), so these are untyped.
declare const document: any, sessionStorage: any, window: any;

/** A site in standard-library Python: a page with a stylesheet and a script that reports what it could do. */
const SITE_PY = String.raw`
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PAGE = b'<!doctype html><html><head><link rel="stylesheet" href="style.css"></head><body><h1>site</h1><a id="next" href="page2">next</a><script src="app.js"></script></body></html>'
JS = b'''
window.result = null;
(async () => {
  const p = location.hash ? JSON.parse(decodeURIComponent(location.hash.slice(1))) : {};
  const r = { origin: self.origin };
  const attempt = async (name, fn) => { try { r[name] = await fn(); } catch (e) { r[name] = "blocked: " + (e && e.name) + " " + (e && e.message); } };
  await attempt("key", () => sessionStorage.getItem("kiln.apiKey"));
  await attempt("storage", () => { sessionStorage.setItem("mine", "1"); return sessionStorage.getItem("mine"); });
  await attempt("cookies", () => document.cookie);
  await attempt("color", () => getComputedStyle(document.body).color);
  if (p.sw) await attempt("sw", async () => (await navigator.serviceWorker.register("sw.js", { scope: p.sw })).scope);
  for (const [name, url] of Object.entries(p.reads || {})) await attempt(name, async () => { const res = await fetch(url, { credentials: "include" }); return res.status + " " + (await res.text()); });
  for (const [name, url] of Object.entries(p.frames || {})) await attempt(name, () => new Promise((resolve, reject) => {
    const f = document.createElement("iframe");
    f.onload = () => { try { resolve("read: " + f.contentDocument.documentElement.outerHTML); } catch (e) { reject(e); } };
    setTimeout(() => reject(new Error("the frame did not load")), 10000);
    f.src = url;
    document.body.appendChild(f);
  }));
  if (p.own) await attempt("own", async () => { const res = await fetch("api"); return res.status + " " + (await res.text()); });
  window.result = r;
})();
'''

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def send(self, code, ctype, body, extra=()):
        self.send_response(code)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        for k, v in extra:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        p = self.path.split("?")[0]
        if p == "/health":
            return self.send(200, "text/plain", b"ok")
        if p == "/":
            planted = [("set-cookie", "own=1; Path=/")]
            if os.environ.get("HOSTILE"):
                # A cookie bomb over Kiln's whole origin, a decoy edge cookie, one for every sibling host.
                planted += [("set-cookie", "bomb=" + "x" * 3000 + "; Path=/"), ("set-cookie", "kiln_edge=decoy; Path=/"), ("set-cookie", "wide=1; Domain=localhost; Path=/")]
                # And a policy of its own that would give the page its origin back, if policies could lift each other.
                planted += [("content-security-policy", "sandbox allow-same-origin allow-scripts")]
            return self.send(200, "text/html", PAGE, planted)
        if p == "/page2":
            return self.send(200, "text/html", b'<!doctype html><p id="two">page two</p>')
        if p == "/style.css":
            return self.send(200, "text/css", b"body { color: rgb(1, 2, 3); }")
        if p == "/app.js":
            return self.send(200, "text/javascript", JS)
        if p == "/sw.js":
            return self.send(200, "text/javascript", b"self.addEventListener('fetch', (e) => e.respondWith(new Response('owned by a service worker')));", [("service-worker-allowed", "/")])
        if p == "/secret":
            return self.send(200, "text/plain", os.environ["SECRET"].encode())
        if p == "/api":
            return self.send(200, "application/json", json.dumps({"cookie": self.headers.get("cookie", ""), "authorization": self.headers.get("authorization", "")}).encode())
        return self.send(404, "text/plain", b"no such page")

ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), H).serve_forever()
`;

const siteCommand = (port: number) => `echo ${Buffer.from(SITE_PY).toString("base64")} | base64 -d > /tmp/site.py && exec python3 /tmp/site.py ${port}`;
const fast = { path: "/health", interval_s: 0.2, timeout_s: 1 };

describe("deployments' pages and the console's origin", () => {
  let k: TestKiln;
  let browser: Browser;
  let page: Page;
  let port: string;
  // hostile: a public site anyone can put a page on; victim: a token deployment holding a secret; echo: WebSockets.
  let hostile: any, victim: any, echo: any;
  const victimSecret = `victim-secret-${randomBytes(8).toString("hex")}`;

  before(async () => {
    await access(join(CONSOLE_DIST_DIR, "index.html")).catch(() => buildConsole());
    // Chromium resolves every *.localhost name to loopback: `<label>.localhost:<port>` is an origin per deployment.
    k = await startTestKiln({ env: { KILN_EDGE_DOMAIN: "localhost", KILN_WARM_POOL: "0" } });
    port = new URL(k.url).port;
    const ready = async (body: Record<string, unknown>) => {
      const dep = await createDeployment(k, { port: 8080, readiness: fast, ...body });
      const [svc] = await services(k, dep.id);
      await waitService(k, dep.id, svc.id, (s) => s.status === "ready", 120_000);
      return (await k.call("GET", `/v1/agent-deployments/${dep.id}`)).body;
    };
    [hostile, victim, echo] = await Promise.all([
      ready({ name: "hostile", command: siteCommand(8080), access: "public", envs: { SECRET: "hostile's own", HOSTILE: "1" } }),
      ready({ name: "victim", command: siteCommand(8080), envs: { SECRET: victimSecret } }),
      ready({ name: "echo", command: appCommand(8080) }),
    ]);
    browser = await launchBrowser();
    page = await browser.newPage();
  });

  after(async () => {
    await browser?.close();
    if (!k) return;
    for (const d of [hostile, victim, echo]) if (d) await k.call("DELETE", `/v1/agent-deployments/${d.id}`);
    await k.close();
  });

  /** The path form of a deployment's URL on the API's own origin, with its token (if it has one). */
  const pathUrl = (dep: any, rest = "") => `${k.url}/edge/${dep.id}/${rest}${new URL(dep.edge_url).search}`;
  const originOf = (dep: any) => new URL(dep.edge_url).origin;

  async function signInToConsole() {
    await page.goto(`${k.url}/console/`);
    if (!(await page.$("nav.top"))) {
      await page.waitForSelector("#api-key", WAIT);
      await page.type("#api-key", TEST_KEY);
      await page.keyboard.press("Enter");
    }
    await page.waitForSelector("nav.top", WAIT);
    assert.equal(await page.evaluate(() => sessionStorage.getItem("kiln.apiKey")), TEST_KEY);
  }

  /** Opens `url` in the console's tab (as following its link there would) and answers what its script reported. */
  async function visit(url: string, plan: Record<string, unknown> = {}): Promise<Record<string, string>> {
    const res = await page.goto(`${url}#${encodeURIComponent(JSON.stringify(plan))}`);
    assert.equal(res?.status(), 200, `${url}: ${res?.status()}`);
    await page.waitForFunction(() => window.result, WAIT);
    return page.evaluate(() => window.result);
  }

  it("with KILN_EDGE_DOMAIN a deployment's URL is an origin of its own, served at /, where Kiln's API, console and keys are not", async () => {
    const label = hostile.id.replace("_", "");
    assert.equal(hostile.edge_url, `http://${label}.localhost:${port}/`);
    assert.match(victim.edge_url, new RegExp(`^http://${victim.id.replace("_", "")}\\.localhost:${port}/\\?edge_token=kse_[A-Za-z0-9_-]{43}$`));
    const [svc] = await services(k, victim.id);
    assert.match(svc.public_url, new RegExp(`^http://${svc.id.replace("_", "")}\\.localhost:${port}/\\?edge_token=kse_`));
    // Node does not resolve *.localhost: the same requests go to the server's address with the edge Host.
    const onHost = async (dep: any, path: string, headers: Record<string, string> = {}) => {
      const res = await request(`${k.url}${path}`, { headers: { host: new URL(dep.edge_url).host, ...headers } });
      return { status: res.statusCode, text: await res.body.text(), headers: res.headers };
    };
    // The whole origin is the deployment's: /v1 and /console are the service's paths, and a key opens nothing.
    const api = await onHost(hostile, "/v1/machines", { authorization: `Bearer ${TEST_KEY}` });
    assert.equal(api.status, 404);
    assert.equal(api.text, "no such page");
    assert.equal((await onHost(hostile, "/console/")).text, "no such page");
    const keyed = await onHost(victim, "/secret", { authorization: `Bearer ${TEST_KEY}` });
    assert.equal(keyed.status, 401, "a key is no edge credential");
    assert.doesNotMatch(keyed.text, new RegExp(victimSecret));
    // The token URL sets a host-only cookie for the whole origin.
    const first = await onHost(victim, `/${new URL(victim.edge_url).search}`);
    assert.equal(first.status, 200);
    const edgeCookie = [first.headers["set-cookie"]].flat().map(String).find((c) => c.startsWith("kiln_edge=kse_"));
    assert.match(String(edgeCookie), /^kiln_edge=kse_[A-Za-z0-9_-]{43}; Path=\/; HttpOnly; SameSite=Lax$/);
    assert.equal(first.headers["content-security-policy"], undefined, "its own origin needs no sandbox");
    // The service's own cookies lose any Domain (host-only: no sibling receives them); it cannot set the edge's.
    const planted = [(await onHost(hostile, "/")).headers["set-cookie"]].flat().map(String);
    assert.ok(planted.some((c) => c.startsWith("wide=1;")) && planted.some((c) => c.startsWith("bomb=")), planted.join("\n"));
    assert.ok(!planted.some((c) => /domain=/i.test(c) || c.startsWith("kiln_edge=")), planted.join("\n"));
    const withCookie = await onHost(victim, "/secret", { cookie: `kiln_edge=decoy; ${String(edgeCookie).split(";")[0]}` });
    assert.equal(withCookie.text, victimSecret, "a decoy edge cookie beside the real one changes nothing");
    // Not an edge host: a label that is no id, or a name outside the domain, is Kiln's API as before.
    const other = await request(`${k.url}/v1/machines`, { headers: { host: `dep0000.localhost:${port}`, authorization: `Bearer ${TEST_KEY}` } });
    assert.equal(other.statusCode, 200);
    await other.body.text();
    // A WebSocket on the deployment's origin, at any path, with the token; refused without it.
    const ws = (q: string) => new WebSocket(`ws://127.0.0.1:${port}/ws${q}`, { headers: { host: new URL(echo.edge_url).host } });
    const open = ws(new URL(echo.edge_url).search);
    await new Promise((resolve, reject) => (open.once("open", resolve), open.once("error", reject)));
    const back = new Promise((resolve) => open.once("message", (d) => resolve(String(d))));
    open.send("over its own origin");
    assert.equal(await back, "over its own origin");
    open.close();
    const refused = ws("");
    const status = await new Promise((resolve) => (refused.once("unexpected-response", (_req, res) => resolve(res.statusCode)), refused.once("error", () => resolve("error"))));
    assert.equal(status, 401);
  });

  it("on the path form a hostile page followed in the console's tab runs in an opaque origin: no key, no other deployment, no service worker, no cookies on Kiln's origin", async () => {
    await signInToConsole();
    // The visitor holds the victim's cookie (its token URL, path form).
    const got = await page.goto(pathUrl(victim));
    assert.equal(got?.status(), 200);
    assert.match(String(got?.headers()["content-security-policy"]), /^sandbox allow-scripts/);
    assert.equal((await page.cookies(`${k.url}/edge/${victim.id}/`)).filter((c) => c.name === "kiln_edge").length, 1);

    const r = await visit(pathUrl(hostile), {
      sw: "/",
      reads: { victim: `/edge/${victim.id}/secret`, victimByService: `/edge/${(await services(k, victim.id))[0].id}/secret`, api: "/v1/machines" },
      frames: { victimFrame: `/edge/${victim.id}/secret`, consoleFrame: "/console/" },
    });
    assert.equal(r.origin, "null", "the page has an opaque origin");
    assert.match(r.key, /^blocked: SecurityError/, "the console's sessionStorage is out of reach");
    assert.match(r.storage, /^blocked: SecurityError/);
    assert.match(r.sw, /^blocked/, "no service worker over Kiln's origin");
    for (const name of ["victim", "victimByService", "api", "victimFrame", "consoleFrame"]) assert.match(r[name], /^blocked/, `${name}: ${r[name]}`);
    assert.doesNotMatch(JSON.stringify(r), new RegExp(`${victimSecret}|${TEST_KEY}`));
    // A normal page still works: its stylesheet and script came from its own path.
    assert.equal(r.color, "rgb(1, 2, 3)");

    // What the hostile service set stayed on its own path: nothing on Kiln's paths, no decoy on the victim's.
    for (const path of ["/console/", "/v1/machines", "/"]) assert.deepEqual((await page.cookies(`${k.url}${path}`)).map((c) => c.name), [], path);
    const victimCookies = (await page.cookies(`${k.url}/edge/${victim.id}/`)).filter((c) => c.name === "kiln_edge");
    assert.equal(victimCookies.length, 1);
    assert.match(victimCookies[0].value, /^kse_/);
    assert.ok((await page.cookies(`${k.url}/edge/${hostile.id}/`)).some((c) => c.name === "bomb" && c.path === `/edge/${hostile.id}/`));
    // The console in the same tab is still signed in and still served.
    await signInToConsole();
    // The victim's page: a link followed from it is a top-level navigation, which carries its cookie.
    await page.goto(pathUrl(victim));
    await Promise.all([page.waitForNavigation(), page.click("#next")]);
    assert.equal(await page.$eval("#two", (e: any) => e.textContent), "page two");
  });

  it("the console links a service's public URL, on its own origin, into a new tab without an opener or a referrer", async () => {
    await signInToConsole();
    await page.goto(`${k.url}/console/#/deployments/${victim.id}`);
    const [svc] = await services(k, victim.id);
    const link = await page.waitForSelector(`a[href^="${originOf({ edge_url: svc.public_url })}/"]`, WAIT);
    assert.deepEqual(await link!.evaluate((a: any) => [a.target, a.rel]), ["_blank", "noopener noreferrer"]);
  });

  it("with KILN_EDGE_DOMAIN a hostile page followed in the console's tab has its own origin: no key, no other deployment's page; a normal page has its fetches and cookies", async () => {
    await signInToConsole();
    // The victim's page on its own origin works as on any site: its stylesheet, its fetches, its cookies, its storage.
    const v = await visit(victim.edge_url, { own: true });
    assert.equal(v.origin, originOf(victim));
    assert.equal(v.color, "rgb(1, 2, 3)");
    assert.equal(v.key, null, "the victim's origin holds no console key either");
    assert.equal(v.storage, "1");
    assert.match(v.cookies, /(^|; )own=1(;|$)/);
    assert.doesNotMatch(v.cookies, /kiln_edge/, "the edge cookie is HttpOnly");
    const own = JSON.parse(v.own.slice(4));
    assert.equal(v.own.slice(0, 4), "200 ");
    assert.match(own.cookie, /own=1/, "the service gets its own cookies");
    assert.doesNotMatch(own.cookie, /kiln_edge/, "never the edge's");

    const r = await visit(hostile.edge_url, {
      // The path form through its own origin reaches its own service, never the victim (even with the victim's token).
      reads: { victim: `${originOf(victim)}/secret`, viaPath: `/edge/${victim.id}/secret${new URL(victim.edge_url).search}`, api: `${k.url}/v1/machines`, consoleIndex: `${k.url}/console/` },
      frames: { victimFrame: `${originOf(victim)}/secret`, consoleFrame: `${k.url}/console/` },
    });
    assert.equal(r.origin, originOf(hostile));
    assert.equal(r.key, null, "the console's key lives in another origin's storage");
    for (const name of ["victim", "api", "consoleIndex", "victimFrame", "consoleFrame"]) assert.match(r[name], /^blocked/, `${name}: ${r[name]}`);
    assert.equal(r.viaPath, "404 no such page");
    assert.doesNotMatch(JSON.stringify(r), new RegExp(`${victimSecret}|${TEST_KEY}`));
    // Its cookies stayed on its own host: none on the victim's origin or Kiln's.
    for (const url of [`${originOf(victim)}/`, `${k.url}/console/`]) {
      const names = (await page.cookies(url)).map((c) => c.name);
      assert.ok(!names.includes("bomb") && !names.includes("wide"), `${url}: ${names}`);
    }
    await signInToConsole();
  });
});
