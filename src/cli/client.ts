// What every CLI command shares: the validated config, and an HTTP client for the Kiln API that finds the
// server (KILN_URL, else http://KILN_HOST:KILN_PORT) and the key (KILN_API_KEY, else $KILN_DATA_DIR/api-key).

import { readFileSync } from "node:fs";
import { join } from "node:path";
import { request } from "undici";
import { ConfigError, loadConfig } from "../config.ts";
import type { Config } from "../config.ts";

export function loadConfigOrExit(): Config {
  try {
    return loadConfig();
  } catch (err) {
    if (err instanceof ConfigError) fail(err.message, 2);
    throw err;
  }
}

export function fail(message: string, code = 1): never {
  process.stderr.write(`kiln: ${message}\n`);
  process.exit(code);
}

export interface ApiClient {
  baseUrl: string;
  key: string;
  call<T>(method: string, path: string, body?: unknown, headers?: Record<string, string>): Promise<T>;
}

/** Every item of a paginated list (`{<items>: [...], next_cursor}`), page by page; `query` adds filters. */
export async function* listAll<T>(client: ApiClient, path: string, items: string, query: Record<string, string> = {}): AsyncGenerator<T> {
  let cursor: string | null = null;
  do {
    const q = new URLSearchParams({ ...query, limit: "100" });
    if (cursor) q.set("cursor", cursor);
    const page = await client.call<Record<string, unknown> & { next_cursor: string | null }>("GET", `${path}?${q}`);
    yield* page[items] as T[];
    cursor = page.next_cursor;
  } while (cursor);
}

export function apiClient(): ApiClient {
  const config = loadConfigOrExit();
  const baseUrl = (process.env.KILN_URL || `http://${config.host}:${config.port}`).replace(/\/+$/, "");
  let key = config.apiKey;
  if (!key) {
    const file = join(config.dataDir, "api-key");
    try {
      key = readFileSync(file, "utf8").trim();
    } catch {
      fail(`no API key: set KILN_API_KEY or run from the directory whose ${file} the server wrote`);
    }
  }
  return {
    baseUrl,
    key,
    async call<T>(method: string, path: string, body?: unknown, headers: Record<string, string> = {}): Promise<T> {
      let res;
      try {
        res = await request(baseUrl + path, {
          method: method as "GET",
          headers: { ...headers, authorization: `Bearer ${key}`, ...(body === undefined ? {} : { "content-type": "application/json" }) },
          body: body === undefined ? undefined : JSON.stringify(body),
        });
      } catch (err) {
        fail(`cannot reach ${baseUrl}: ${(err as Error).message} (is \`kiln serve\` running?)`);
      }
      const text = await res.body.text();
      const parsed = text ? JSON.parse(text) : undefined;
      if (res.statusCode >= 400) fail(`${parsed?.code ?? res.statusCode}: ${parsed?.error ?? text} (request ${parsed?.request_id ?? "?"})`);
      return parsed as T;
    },
  };
}
