// Sign in: the API key goes in a password field, is checked with one authenticated call, and is kept in this tab's
// sessionStorage only (gone when the tab closes; never in a URL, cookie or log).

import { useState } from "preact/hooks";
import { api, ApiError, session } from "../api.ts";

export function SignIn({ onSignedIn }: { onSignedIn: () => void }) {
  const [key, setKey] = useState("");
  const [error, setError] = useState<string>();
  const [busy, setBusy] = useState(false);
  const submit = async (e: Event) => {
    e.preventDefault();
    const trimmed = key.trim();
    if (!trimmed) return setError("Paste an API key first.");
    setBusy(true);
    setError(undefined);
    try {
      await api("GET", "/v1/machines?limit=1", undefined, { key: trimmed });
      session.signIn(trimmed);
      setKey("");
      onSignedIn();
    } catch (err) {
      setError(err instanceof ApiError && err.status === 401 ? "That key was refused: check it, or make one with `bin/kiln keys create`." : (err as Error).message);
    } finally {
      setBusy(false);
    }
  };
  return (
    <main class="signin">
      <form onSubmit={submit} aria-label="Sign in">
        <h1>Kiln</h1>
        <p>Sign in with an API key. A new server writes its first key to <code>.kiln/api-key</code>.</p>
        <label for="api-key">API key</label>
        <input id="api-key" name="api-key" type="password" autocomplete="off" spellcheck={false} autofocus value={key} onInput={(e) => setKey((e.target as HTMLInputElement).value)} />
        <button type="submit" disabled={busy}>
          {busy ? "Checking…" : "Sign in"}
        </button>
        {error ? (
          <p class="error" role="alert">
            {error}
          </p>
        ) : null}
        <p class="muted">The key stays in this tab only and is sent to this server in the Authorization header.</p>
      </form>
    </main>
  );
}
