// Sandbox ids on the E2B surface: a Kiln machine id without its `mch_` prefix — the 26 lowercase letters and digits
// of its Crockford base32 body — so `<port>-<id>.<domain>` is a valid DNS label (wildcard DNS, TLS certificates), as
// E2B's own ids are. One to one and stable: nothing is stored, the native API keeps `mch_…`. The layer works on
// machine ids inside and translates at its edges (paths, headers, Host names in; ids in answers out).

const BODY = "[0-9a-hjkmnp-tv-z]{26}";
const SANDBOX_ID = new RegExp(`^${BODY}$`);
const MACHINE_ID = new RegExp(`^mch_(${BODY})$`);

/** The regular-expression source of a sandbox id (for Host names). */
export const SANDBOX_ID_SOURCE = BODY;

/** The E2B sandbox id of a Kiln machine. */
export function sandboxIdOf(machineId: string): string {
  const m = MACHINE_ID.exec(machineId);
  return m ? m[1] : machineId;
}

/**
 * The Kiln machine a sandbox id names, or undefined for text that is no sandbox id. A `mch_` id is taken too (what
 * Kiln's E2B layer answered before ids were made hostname-safe), so old clients' ids keep working.
 */
export function machineIdOf(sandboxId: string): string | undefined {
  if (SANDBOX_ID.test(sandboxId)) return `mch_${sandboxId}`;
  return MACHINE_ID.test(sandboxId) ? sandboxId : undefined;
}
