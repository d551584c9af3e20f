// The console's shell: sign in with an API key (kept in sessionStorage for this tab only), then one view per API
// group behind hash routes, with `g`-prefixed keyboard shortcuts.

import "./style-nonce.ts";
import "@xterm/xterm/css/xterm.css";
import "./styles.css";
import { render } from "preact";
import { useEffect, useState } from "preact/hooks";
import { firstPagePath, prefetch, session } from "./api.ts";
import { currentPath, go, href, useRoute } from "./router.ts";
import { SignIn } from "./views/signin.tsx";
import { Machines, TEMPLATES_PATH } from "./views/machines.tsx";
import { MachinePage } from "./views/machine.tsx";
import { Templates, TemplatePage } from "./views/templates.tsx";
import { BuildPage } from "./views/build.tsx";
import { Volumes } from "./views/volumes.tsx";
import { Deployments, DeploymentPage } from "./views/deployments.tsx";
import { Webhooks, WebhookPage } from "./views/webhooks.tsx";
import { Hosts } from "./views/hosts.tsx";

const SECTIONS = [
  { key: "m", path: "machines", label: "Machines" },
  { key: "t", path: "templates", label: "Templates" },
  { key: "v", path: "volumes", label: "Volumes" },
  { key: "d", path: "deployments", label: "Deployments" },
  { key: "w", path: "webhooks", label: "Webhooks" },
  { key: "h", path: "hosts", label: "Hosts" },
];

function typingIn(target: EventTarget | null): boolean {
  const el = target as HTMLElement | null;
  return !!el && (el.isContentEditable || ["INPUT", "TEXTAREA", "SELECT"].includes(el.tagName) || !!el.closest(".xterm"));
}

/** `g` then a section's letter goes there; `/` focuses the view's filter; `?` shows the keys. */
function useShortcuts(setHelp: (fn: (v: boolean) => boolean) => void) {
  useEffect(() => {
    let pendingG = 0;
    const onKey = (e: KeyboardEvent) => {
      if (e.ctrlKey || e.metaKey || e.altKey || typingIn(e.target)) return;
      if (e.key === "g") {
        pendingG = Date.now();
        return;
      }
      if (Date.now() - pendingG < 1500) {
        pendingG = 0;
        const section = SECTIONS.find((s) => s.key === e.key);
        if (section) {
          e.preventDefault();
          go(section.path);
        }
        return;
      }
      if (e.key === "/") {
        const filter = document.querySelector<HTMLInputElement>("input[data-filter]");
        if (filter) {
          e.preventDefault();
          filter.focus();
        }
      } else if (e.key === "?") setHelp((v) => !v);
    };
    window.addEventListener("keydown", onKey);
    return () => window.removeEventListener("keydown", onKey);
  }, []);
}

function View({ path }: { path: string[] }) {
  const [section, id, sub, subId] = path;
  switch (section) {
    case "machines":
      return id ? <MachinePage id={id} tab={sub} /> : <Machines />;
    case "templates":
      if (id && sub === "builds" && subId) return <BuildPage templateId={id} buildId={subId} />;
      return id ? <TemplatePage id={id} /> : <Templates />;
    case "volumes":
      return <Volumes />;
    case "deployments":
      return id ? <DeploymentPage id={id} /> : <Deployments />;
    case "webhooks":
      return id ? <WebhookPage id={id} /> : <Webhooks />;
    case "hosts":
      return <Hosts />;
    default:
      return <Machines />;
  }
}

function App() {
  const [key, setKey] = useState(session.key());
  const [help, setHelp] = useState(false);
  const path = useRoute();
  useShortcuts(setHelp);
  useEffect(() => {
    const out = () => setKey(null);
    window.addEventListener("kiln:signed-out", out);
    return () => window.removeEventListener("kiln:signed-out", out);
  }, []);
  if (!key) return <SignIn onSignedIn={() => setKey(session.key())} />;
  const current = path[0] ?? "machines";
  return (
    <div class="shell">
      <nav class="top" aria-label="Sections">
        <a class="brand" href={href("machines")}>
          Kiln
        </a>
        {SECTIONS.map((s) => (
          <a href={href(s.path)} class={current === s.path ? "active" : ""} aria-current={current === s.path ? "page" : undefined} title={`g ${s.key}`}>
            {s.label}
          </a>
        ))}
        <span class="spacer" />
        <button type="button" class="link" onClick={() => setHelp((v) => !v)} title="?">
          Keys
        </button>
        <button type="button" class="link" onClick={() => session.signOut()}>
          Sign out
        </button>
      </nav>
      {help ? (
        <aside class="help" aria-label="Keyboard shortcuts">
          {SECTIONS.map((s) => (
            <span>
              <kbd>g</kbd> <kbd>{s.key}</kbd> {s.label}
            </span>
          ))}
          <span>
            <kbd>/</kbd> filter
          </span>
          <span>
            <kbd>?</kbd> this help
          </span>
        </aside>
      ) : null}
      <main>
        {/* Keyed by the route: following a link (or the same view's link again) loads the view afresh. */}
        <View key={path.join("/")} path={path} />
      </main>
    </div>
  );
}

// The machine list is the view most sessions open first: its reads start now, not after the first render.
const [section, id] = currentPath();
if ((section ?? "machines") === "machines" && !id) {
  prefetch(firstPagePath("/v1/machines"));
  prefetch(TEMPLATES_PATH);
}

const root = document.getElementById("app")!;
root.textContent = "";
render(<App />, root);
