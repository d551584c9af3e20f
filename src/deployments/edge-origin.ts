// Which browser origin a deployment's pages get. With KILN_EDGE_DOMAIN each deployment (and each service) has an
// origin of its own, `<label>.<edge domain>` served at `/`, so its pages can read neither the console's storage nor
// another deployment's pages. Without it the edge serves `/edge/<id>/…` on the API's origin, and every answer there
// is sandboxed (an opaque origin: no storage, cookies or same-origin reads of anything on Kiln's origin).
// docs/security/edge.md says why, docs/deployments.md what it costs a page.

/** A deployment or service id as a DNS label: `dep_0123…` is `dep0123…` (ids are lower-case Crockford base32). */
export function edgeLabel(id: string): string {
  return id.replace("_", "");
}

const LABEL_RE = /^(dep|svc)([0-9a-hjkmnp-tv-z]{26})$/;

/** What KILN_EDGE_DOMAIN names: a host name (lower case) and, when given, the port public URLs carry. */
export interface EdgeDomain {
  host: string;
  port: string | undefined;
}

/**
 * Parses KILN_EDGE_DOMAIN: `edge.example.com` or `localhost:8080` (host name labels, optional port; no scheme, path
 * or IP address — an IP has no subdomains). Undefined for anything else (config.ts says what it wants).
 */
export function parseEdgeDomain(value: string): EdgeDomain | undefined {
  const m = /^([a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)*)(?::(\d{1,5}))?$/.exec(value.trim().toLowerCase());
  if (!m || /^[0-9.]+$/.test(m[1]) || m[1].length > 200) return undefined;
  if (m[2] !== undefined && (Number(m[2]) < 1 || Number(m[2]) > 65535)) return undefined;
  return { host: m[1], port: m[2] };
}

/**
 * The id a request's Host names on the edge domain (`dep…`/`svc…` label + the domain, any case; the port must be
 * the domain's when it names one), or undefined: not an edge host.
 */
export function idOfEdgeHost(host: string | undefined, domain: EdgeDomain): string | undefined {
  if (!host) return undefined;
  const h = host.toLowerCase();
  const colon = h.lastIndexOf(":");
  const name = colon >= 0 && !h.endsWith("]") ? h.slice(0, colon) : h;
  const port = colon >= 0 && !h.endsWith("]") ? h.slice(colon + 1) : undefined;
  if (domain.port !== undefined && port !== domain.port) return undefined;
  if (!name.endsWith(`.${domain.host}`)) return undefined;
  const m = LABEL_RE.exec(name.slice(0, -(domain.host.length + 1)));
  return m ? `${m[1]}_${m[2]}` : undefined;
}

/** `<scheme>://<label>.<domain>[:port]`: the scheme of KILN_PUBLIC_URL; the domain's port, else the public URL's. */
export function edgeOriginOf(id: string, domain: EdgeDomain, publicUrl: string): string {
  const base = new URL(publicUrl);
  const port = domain.port ?? base.port;
  return `${base.protocol}//${edgeLabel(id)}.${domain.host}${port ? `:${port}` : ""}`;
}

/**
 * What every answer of the path-based edge (`/edge/<id>/…` on Kiln's own origin) carries: a CSP sandbox without
 * `allow-same-origin`, so the page runs in an opaque origin — it cannot read the console's sessionStorage (the API
 * key), set or read cookies of Kiln's origin, or read another deployment's pages. Scripts, forms, popups, modals
 * and downloads still work. A service's own CSP adds to it; none can lift it.
 */
export const PATH_EDGE_SANDBOX = "sandbox allow-scripts allow-forms allow-popups allow-popups-to-escape-sandbox allow-modals allow-downloads";

/**
 * A service's `Set-Cookie` on the path-based edge, confined to its own prefix: `Path=/x` becomes
 * `Path=/edge/<id>/x`, and a cookie with a `Domain` is dropped — else a page could plant cookies on every path of
 * Kiln's origin (a few kilobytes each, enough to make every API and console request too large to be served) or on
 * another deployment's path. A cookie named `reserved` (the edge's) is dropped. Undefined when nothing is left.
 */
export function confinePathCookies(value: string | string[] | number | undefined, id: string, reserved: string): string[] | undefined {
  if (value === undefined) return undefined;
  const out: string[] = [];
  for (const cookie of serviceCookies(value, reserved)) {
    const parts = cookie.split(";");
    let keep = true;
    const attrs = parts.slice(1).map((a) => {
      const [k, ...v] = a.trim().split("=");
      const key = k.toLowerCase();
      if (key === "domain") keep = false;
      if (key === "path") {
        const p = v.join("=").trim();
        return ` Path=/edge/${id}${p.startsWith("/") ? p : `/${p}`}`;
      }
      return a;
    });
    if (keep) out.push([parts[0], ...attrs].join(";"));
  }
  return out.length > 0 ? out : undefined;
}

/**
 * A service's `Set-Cookie` on its own origin: a `Domain` attribute goes (the cookie stays host-only), so no sibling
 * deployment or parent domain receives it. Undefined when nothing is left.
 */
export function hostOnlyCookies(value: string | string[] | number | undefined, reserved: string): string[] | undefined {
  if (value === undefined) return undefined;
  const kept = serviceCookies(value, reserved);
  if (kept.length === 0) return undefined;
  return kept.map((cookie) =>
    cookie
      .split(";")
      .filter((a, i) => i === 0 || a.trim().split("=")[0].toLowerCase() !== "domain")
      .join(";"),
  );
}

/** A service's cookies but any named `reserved` (the edge's own cookie: a service's of that name would overwrite it). */
function serviceCookies(value: string | string[] | number, reserved: string): string[] {
  return (Array.isArray(value) ? value : [String(value)]).filter((c) => c.split(";")[0].split("=")[0].trim() !== reserved);
}
