// Real headless Chromium (Debian's `chromium`) driven by puppeteer-core, for the console's tests and benchmarks:
// every page records its errors (uncaught exceptions, console errors, CSP violations, failed requests) and every
// URL it asked for, so a test can assert that none went wrong and that no secret ever reached a URL.

import { mkdir } from "node:fs/promises";
import { join } from "node:path";
import puppeteer from "puppeteer-core";
import type { Browser, Page } from "puppeteer-core";

export const CHROMIUM = process.env.KILN_TEST_CHROMIUM ?? "/usr/bin/chromium";
/** Screenshots the console tests keep (gitignored). */
export const ARTIFACTS_DIR = join(import.meta.dirname, "..", "..", "test-artifacts", "console");

export interface WatchedPage {
  page: Page;
  /** Everything that went wrong in the page, as text. */
  problems: string[];
  /** Every URL the page requested (documents, scripts, fetches, WebSockets). */
  urls: string[];
  screenshot(name: string): Promise<void>;
}

export async function launchBrowser(): Promise<Browser> {
  // Root in a test container: Chromium's own sandbox needs an unprivileged user, so it is off here.
  return puppeteer.launch({
    executablePath: CHROMIUM,
    headless: true,
    args: ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run", "--window-size=1400,900"],
    defaultViewport: { width: 1400, height: 900 },
  });
}

export async function watchedPage(browser: Browser): Promise<WatchedPage> {
  const page = await browser.newPage();
  const problems: string[] = [];
  const urls: string[] = [];
  page.on("pageerror", (err) => problems.push(`page error: ${(err as Error).message ?? String(err)}`));
  page.on("console", (msg) => {
    if (msg.type() === "error") problems.push(`console error: ${msg.text()}`);
  });
  page.on("request", (req) => urls.push(req.url()));
  page.on("requestfailed", (req) => {
    // Requests the page itself aborts (a view left while its fetch or stream ran) are not failures.
    if (req.failure()?.errorText !== "net::ERR_ABORTED") problems.push(`request failed: ${req.url()} ${req.failure()?.errorText}`);
  });
  const cdp = await page.createCDPSession();
  await cdp.send("Network.enable");
  cdp.on("Network.webSocketCreated", (ev: { url: string }) => urls.push(ev.url));
  await mkdir(ARTIFACTS_DIR, { recursive: true });
  return {
    page,
    problems,
    urls,
    screenshot: async (name) => {
      await page.screenshot({ path: join(ARTIFACTS_DIR, `${name}.png`) as `${string}.png`, fullPage: true });
    },
  };
}
