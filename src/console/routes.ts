// GET /console: the web console's static files (dist/console, built by bundle.ts), public like /health — the page
// asks for an API key and sends it only in Authorization headers (and a WebSocket subprotocol), never in a URL or
// cookie. Every answer carries a strict Content-Security-Policy; index.html gets a fresh style nonce per response.

import { randomBytes } from "node:crypto";
import { readFile } from "node:fs/promises";
import { join } from "node:path";
import fastifyStatic from "@fastify/static";
import type { FastifyReply } from "fastify";
import type { App } from "../api/app-type.ts";
import { KilnError } from "../errors.ts";
import { CONSOLE_DIST_DIR, NONCE_PLACEHOLDER } from "./bundle.ts";

/**
 * Scripts only from our own origin; styles from our own origin plus `<style>` elements carrying this response's
 * nonce (xterm.js makes its own, console/src/style-nonce.ts stamps them); requests only to our own origin (fetch,
 * SSE and the machine WebSocket); no frames, forms, plugins or base-URI tricks.
 */
function contentSecurityPolicy(nonce: string | null): string {
  return [
    "default-src 'none'",
    "script-src 'self'",
    nonce ? `style-src 'self' 'nonce-${nonce}'` : "style-src 'self'",
    "img-src 'self' data: blob:",
    "font-src 'self'",
    "connect-src 'self'",
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
  ].join("; ");
}

function secureHeaders(reply: FastifyReply, nonce: string | null) {
  reply.header("content-security-policy", contentSecurityPolicy(nonce));
  reply.header("x-content-type-options", "nosniff");
  reply.header("referrer-policy", "no-referrer");
  reply.header("x-frame-options", "DENY");
  reply.header("cross-origin-opener-policy", "same-origin");
  reply.header("cross-origin-resource-policy", "same-origin");
}

export async function consoleRoutes(app: App, opts: { distDir?: string } = {}) {
  const root = opts.distDir ?? CONSOLE_DIST_DIR;
  // Assets are served by @fastify/static (ETag, ranges, no path escapes) through routes that declare their auth.
  await app.register(fastifyStatic, { root, serve: false, decorateReply: true, index: false, dotfiles: "deny" });

  // index.html is read once it exists (a build after the server started is picked up on the next request).
  let index: string | undefined;
  async function indexHtml(): Promise<string> {
    index ??= await readFile(join(root, "index.html"), "utf8").catch(() => undefined);
    if (index === undefined) throw new KilnError("unavailable", "The console is not built: run `npm run build:console` (scripts/up.sh does it) and reload");
    return index;
  }

  const config = { auth: "none" as const };
  const schema = { hide: true };
  // One route for /console and /console/ (the server ignores trailing slashes); assets are named absolutely.
  app.get("/console", { config, schema }, async (_req, reply) => {
    const nonce = randomBytes(18).toString("base64");
    const html = (await indexHtml()).replaceAll(NONCE_PLACEHOLDER, nonce);
    secureHeaders(reply, nonce);
    // The page names hashed assets: it must be fetched again on every visit, they never need to be.
    reply.header("cache-control", "no-store");
    return reply.type("text/html; charset=utf-8").send(html);
  });
  app.get("/console/assets/*", { config, schema }, async (req, reply) => {
    const file = (req.params as { "*": string })["*"];
    if (!/^[A-Za-z0-9._-]{1,200}$/.test(file) || file.startsWith(".")) throw new KilnError("not_found", `No console asset ${file.slice(0, 200)}`);
    secureHeaders(reply, null);
    // Asset names carry their content hash.
    reply.header("cache-control", "public, max-age=31536000, immutable");
    return reply.sendFile(join("assets", file), { cacheControl: false });
  });
}
