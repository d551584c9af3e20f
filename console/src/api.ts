// The console's only way to the server: Kiln's public HTTP API with the key from sessionStorage in the
// Authorization header. Error envelopes become ApiError; a refused key signs the tab out.

const KEY_ITEM = "kiln.apiKey";

export const session = {
  key(): string | null {
    return sessionStorage.getItem(KEY_ITEM);
  },
  signIn(key: string) {
    sessionStorage.setItem(KEY_ITEM, key);
  },
  signOut() {
    sessionStorage.removeItem(KEY_ITEM);
    window.dispatchEvent(new CustomEvent("kiln:signed-out"));
  },
};

export class ApiError extends Error {
  constructor(
    message: string,
    readonly status: number,
    readonly code: string,
    readonly requestId?: string,
  ) {
    super(message);
  }
}

export function authHeaders(key = session.key()): Record<string, string> {
  return key ? { authorization: `Bearer ${key}` } : {};
}

async function failure(res: Response): Promise<ApiError> {
  let body: { error?: string; code?: string; request_id?: string } = {};
  try {
    body = await res.json();
  } catch {
    // not an envelope (a proxy in between): the status says enough
  }
  return new ApiError(body.error ?? `${res.status} ${res.statusText}`, res.status, body.code ?? "http_error", body.request_id);
}

export async function request(method: string, path: string, body?: unknown, opts: { key?: string; signal?: AbortSignal } = {}): Promise<Response> {
  const headers: Record<string, string> = { ...authHeaders(opts.key ?? session.key()) };
  if (body !== undefined) headers["content-type"] = "application/json";
  const res = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body), cache: "no-store", signal: opts.signal });
  if (!res.ok) {
    const err = await failure(res);
    if (err.status === 401 && opts.key === undefined) session.signOut();
    throw err;
  }
  return res;
}

export async function api<T>(method: string, path: string, body?: unknown, opts: { key?: string; signal?: AbortSignal } = {}): Promise<T> {
  const res = await request(method, path, body, opts);
  const text = await res.text();
  return (text ? JSON.parse(text) : undefined) as T;
}

/**
 * Whether this server has a route (a feature of a newer Kiln: hosts, snapshots), read once from its public OpenAPI
 * document instead of probing the route and showing a 404.
 */
let openapiPaths: Promise<Set<string>> | undefined;
export async function hasRoute(path: string): Promise<boolean> {
  openapiPaths ??= fetch("/v1/openapi.json", { cache: "no-store" })
    .then((res) => (res.ok ? res.json() : { paths: {} }))
    .then((doc: { paths?: Record<string, unknown> }) => new Set(Object.keys(doc.paths ?? {})));
  return (await openapiPaths).has(path);
}

export const get = <T>(path: string, signal?: AbortSignal) => api<T>("GET", path, undefined, { signal });

/**
 * Reads started while the page boots (main.tsx), before the first view mounts and asks for them: the view's first
 * request is then already on its way instead of waiting for the bundle to run and the view's effect (a frame later).
 * Each is taken once; later reads go to the server as usual.
 */
const early = new Map<string, Promise<unknown>>();
export function prefetch(path: string) {
  if (!session.key() || early.has(path)) return;
  const answer = get(path);
  answer.catch(() => undefined); // whoever takes it sees the error
  early.set(path, answer);
}
export function getEarly<T>(path: string, signal?: AbortSignal): Promise<T> {
  const answer = early.get(path);
  if (!answer) return get<T>(path, signal);
  early.delete(path);
  return answer as Promise<T>;
}

export function q(params: Record<string, string | number | undefined | null>): string {
  const s = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== undefined && v !== null && v !== "") s.set(k, String(v));
  const text = s.toString();
  return text ? `?${text}` : "";
}

export const enc = encodeURIComponent;

/** The first page of a list as allPages asks for it (main.tsx prefetches it). */
export function firstPagePath(path: string): string {
  return `${path}${path.includes("?") ? "&" : "?"}limit=100`;
}

/**
 * Every page of a cursor-paged list, handed over page by page, at most `maxPages`. The next page is asked for
 * before `onPage` runs, so a view rendering one page does not hold the request for the next one behind it.
 */
export async function allPages<T>(path: string, field: string, onPage: (items: T[], done: boolean) => void | Promise<void>, opts: { signal?: AbortSignal; maxPages?: number } = {}) {
  const maxPages = opts.maxPages ?? 50;
  const read = (cursor: string | null): Promise<Record<string, unknown>> => {
    const url = firstPagePath(path) + (cursor ? `&cursor=${enc(cursor)}` : "");
    return cursor === null ? getEarly(url, opts.signal) : get(url, opts.signal);
  };
  let pending = read(null);
  for (let page = 0; page < maxPages; page++) {
    const body = await pending;
    const cursor = (body.next_cursor as string | null) ?? null;
    const done = cursor === null || page + 1 >= maxPages;
    if (!done) {
      pending = read(cursor);
      pending.catch(() => undefined); // awaited on the next turn; a failure then is the caller's
    }
    await onPage((body[field] as T[]) ?? [], done);
    if (done) return;
  }
}

// Records as the API answers them (the fields the console shows).
export interface Machine {
  id: string;
  name: string | null;
  status: string;
  template_id: string;
  artifact_id: string;
  host_id?: string | null;
  user: string;
  cwd: string | null;
  vcpus: number;
  memory_mb: number;
  disk_mb: number;
  created_at: string;
  expires_at: string;
  failure_reason: string | null;
}
export interface Template {
  template_id: string;
  canonical_ref: string;
  name: string;
  aliases: string[];
  tags: Record<string, string>;
  updated_at: string;
}
export interface Build {
  build_id: string;
  template_id: string;
  status: string;
  source_type: string;
  build_backend: string;
  created_at: string;
  started_at?: string | null;
  finished_at?: string | null;
  duration_ms?: number | null;
  failure_phase?: string | null;
  tags: string[];
}
export interface BuildEntry {
  kind: string;
  level: string;
  message: string;
  timestamp?: string;
  phase?: string;
  step_index?: number;
  total_steps?: number;
  error_detail?: { code?: string; message?: string };
}
export interface Webhook {
  id: string;
  url: string;
  operations: string[];
  enabled: boolean;
  created_at: string;
}
export interface Delivery {
  id: string;
  operation: string;
  status: string;
  attempts: { attempt: number; status_code: number | null; error: string | null; started_at: string; duration_ms: number }[];
  next_attempt_at: string | null;
  last_status_code: number | null;
  last_error: string | null;
  created_at: string;
}
export interface FileEntry {
  name: string;
  path: string;
  is_dir: boolean;
  size: number;
  type: string;
  permissions: string;
  owner: string;
  modified_time: string;
  symlink_target?: string;
}
