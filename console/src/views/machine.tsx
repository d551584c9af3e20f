// One machine: its record and lifecycle actions, then tabs for a live terminal, its files, its metrics and its
// snapshots (shown when the server has snapshots).

import { useEffect, useState } from "preact/hooks";
import type { FunctionComponent } from "preact";
import { api, enc, get, hasRoute, q, request, type FileEntry, type Machine } from "../api.ts";
import { go, href } from "../router.ts";
import { age, bytes, ConfirmButton, Empty, ErrorNote, Section, Status, until, useAction, useLoad, when } from "../ui.tsx";
import { useTemplateNames } from "./machines.tsx";

const TABS = ["terminal", "files", "metrics", "snapshots"] as const;

// xterm.js is most of the console's weight: it is loaded when a terminal is first opened, not with the lists.
let terminalModule: Promise<{ Terminal: FunctionComponent<{ machineId: string }> }> | undefined;
function LazyTerminal({ machineId }: { machineId: string }) {
  const [Term, setTerm] = useState<FunctionComponent<{ machineId: string }>>();
  const [error, setError] = useState<Error>();
  useEffect(() => {
    terminalModule ??= import("./terminal.tsx");
    terminalModule.then((m) => setTerm(() => m.Terminal), setError);
  }, []);
  if (error) return <ErrorNote error={error} />;
  return Term ? <Term machineId={machineId} /> : <p class="muted">Loading the terminal…</p>;
}
const VIEW_BYTES = 256 * 1024;

async function readAtMost(res: Response, limit: number): Promise<Uint8Array> {
  const reader = res.body!.getReader();
  const chunks: Uint8Array[] = [];
  let size = 0;
  while (size < limit) {
    const { value, done } = await reader.read();
    if (done) break;
    chunks.push(value);
    size += value.length;
  }
  await reader.cancel().catch(() => undefined);
  const out = new Uint8Array(Math.min(size, limit));
  let at = 0;
  for (const c of chunks) {
    const part = c.subarray(0, out.length - at);
    out.set(part, at);
    at += part.length;
    if (at >= out.length) break;
  }
  return out;
}

export function MachinePage({ id, tab }: { id: string; tab?: string }) {
  const machine = useLoad((signal) => get<Machine>(`/v1/machines/${enc(id)}`, signal), [id], 5000);
  const templates = useTemplateNames();
  const [error, run, busy] = useAction();
  const m = machine.data;
  const current = TABS.includes(tab as (typeof TABS)[number]) ? tab : "terminal";
  if (!m) return machine.error ? <ErrorNote error={machine.error} /> : <p class="muted">Loading…</p>;
  const running = m.status === "running";
  return (
    <>
      <Section
        title={
          <>
            <a href={href("machines")}>Machines</a> / {m.name ?? m.id}
          </>
        }
        actions={
          <>
            {running ? (
              <button type="button" disabled={busy} onClick={() => run(async () => (await api("POST", `/v1/machines/${enc(id)}/hibernate`), machine.reload()))}>
                Hibernate
              </button>
            ) : null}
            {m.status === "hibernated" ? (
              <button type="button" disabled={busy} onClick={() => run(async () => (await api("POST", `/v1/machines/${enc(id)}/resume`), machine.reload()))}>
                Resume
              </button>
            ) : null}
            {m.status !== "destroyed" ? <ConfirmButton label="Destroy" confirm="Really destroy?" onConfirm={() => run(async () => (await api("DELETE", `/v1/machines/${enc(id)}`), go("machines")))} /> : null}
          </>
        }
      >
        <ErrorNote error={error} />
        <dl class="facts">
          <dt>Id</dt>
          <dd>{m.id}</dd>
          <dt>Status</dt>
          <dd>
            <Status value={m.status} />
            {m.failure_reason ? <span class="error"> {m.failure_reason}</span> : null}
          </dd>
          <dt>Template</dt>
          <dd>{templates.get(m.template_id) ?? m.template_id}</dd>
          <dt>Host</dt>
          <dd>{m.host_id ?? "this host"}</dd>
          <dt>Size</dt>
          <dd>
            {m.vcpus} vCPU, {m.memory_mb} MiB memory, {m.disk_mb} MiB disk
          </dd>
          <dt>Created</dt>
          <dd title={when(m.created_at)}>{age(m.created_at)} ago</dd>
          <dt>Expires</dt>
          <dd title={when(m.expires_at)}>{m.status === "destroyed" ? "—" : until(m.expires_at)}</dd>
        </dl>
      </Section>
      <nav class="tabs" aria-label="Machine views">
        {TABS.map((t) => (
          <a href={href("machines", id, t)} class={t === current ? "active" : ""} aria-current={t === current ? "page" : undefined}>
            {t[0].toUpperCase() + t.slice(1)}
          </a>
        ))}
      </nav>
      {!running && current !== "snapshots" ? (
        <Empty title={`This machine is ${m.status}`}>
          <p>{m.status === "hibernated" ? "Resume it to open a terminal, browse its files or read its metrics." : "Its terminal, files and metrics are gone with it."}</p>
        </Empty>
      ) : current === "terminal" ? (
        <LazyTerminal machineId={id} />
      ) : current === "files" ? (
        <Files machine={m} />
      ) : current === "metrics" ? (
        <Metrics id={id} />
      ) : (
        <Snapshots id={id} running={running} />
      )}
    </>
  );
}

function Files({ machine }: { machine: Machine }) {
  const [path, setPath] = useState(machine.cwd ?? "/workspace");
  const [typed, setTyped] = useState(path);
  const [open, setOpen] = useState<{ path: string; text: string | null; size: number }>();
  const base = `/v1/machines/${enc(machine.id)}/files`;
  const list = useLoad((signal) => get<{ entries: FileEntry[] }>(`${base}/list${q({ path, depth: 1, limit: 1000 })}`, signal), [path]);
  const [error, run] = useAction();
  const cd = (p: string) => {
    setPath(p);
    setTyped(p);
    setOpen(undefined);
  };
  const view = (entry: FileEntry) =>
    run(async () => {
      const res = await request("GET", `${base}${q({ path: entry.path })}`);
      // At most the first 256 KiB are read: a large file is not pulled whole into the tab.
      const buf = await readAtMost(res, VIEW_BYTES);
      let text: string | null = null;
      try {
        text = new TextDecoder("utf-8", { fatal: true }).decode(buf, { stream: buf.length >= VIEW_BYTES });
      } catch {
        text = null;
      }
      setOpen({ path: entry.path, text, size: entry.size });
    });
  const parent = path === "/" ? null : path.replace(/\/[^/]*\/?$/, "") || "/";
  return (
    <Section title="Files">
      <form
        class="inline-form"
        onSubmit={(e) => {
          e.preventDefault();
          cd(typed.trim() || "/");
        }}
      >
        <label>
          Path
          <input value={typed} onInput={(e) => setTyped((e.target as HTMLInputElement).value)} aria-label="Directory path" />
        </label>
        <button type="submit">Open</button>
        {parent !== null ? (
          <button type="button" onClick={() => cd(parent)}>
            Up
          </button>
        ) : null}
      </form>
      <ErrorNote error={list.error ?? error} />
      {list.data && list.data.entries.length === 0 ? <Empty title="This directory is empty" /> : null}
      {list.data && list.data.entries.length > 0 ? (
        <table class="list" aria-label="Files">
          <thead>
            <tr>
              <th>Name</th>
              <th>Size</th>
              <th>Mode</th>
              <th>Owner</th>
              <th>Modified</th>
            </tr>
          </thead>
          <tbody>
            {list.data.entries.map((f) => (
              <tr>
                <td>
                  <button type="button" class="link" onClick={() => (f.is_dir ? cd(f.path) : view(f))}>
                    {f.name}
                    {f.is_dir ? "/" : ""}
                  </button>
                  {f.symlink_target ? <span class="muted"> → {f.symlink_target}</span> : null}
                </td>
                <td>{f.is_dir ? "—" : bytes(f.size)}</td>
                <td>{f.permissions}</td>
                <td>{f.owner}</td>
                <td title={when(f.modified_time)}>{age(f.modified_time)} ago</td>
              </tr>
            ))}
          </tbody>
        </table>
      ) : null}
      {open ? (
        <div class="file-view">
          <h3>{open.path}</h3>
          {open.text === null ? <p class="muted">Binary file, {bytes(open.size)}.</p> : <pre>{open.text}</pre>}
          {open.size > VIEW_BYTES ? <p class="muted">Showing the first 256 KiB of {bytes(open.size)}.</p> : null}
        </div>
      ) : null}
    </Section>
  );
}

interface MetricsT {
  cpu_count: number;
  cpu_used_pct: number | null;
  mem_used_bytes: number | null;
  mem_total_bytes: number;
  disk_used_bytes: number | null;
  disk_total_bytes: number | null;
  timestamp: string;
}

function Metrics({ id }: { id: string }) {
  const metrics = useLoad((signal) => get<MetricsT>(`/v1/machines/${enc(id)}/metrics`, signal), [id], 2000);
  const m = metrics.data;
  return (
    <Section title="Metrics">
      <ErrorNote error={metrics.error} />
      {m ? (
        <dl class="facts" aria-label="Metrics">
          <dt>CPU</dt>
          <dd>{m.cpu_used_pct === null ? "—" : `${m.cpu_used_pct.toFixed(1)} % of ${m.cpu_count} vCPU`}</dd>
          <dt>Memory</dt>
          <dd>
            {bytes(m.mem_used_bytes)} of {bytes(m.mem_total_bytes)}
          </dd>
          <dt>Disk</dt>
          <dd>
            {bytes(m.disk_used_bytes)} of {bytes(m.disk_total_bytes)}
          </dd>
          <dt>Read</dt>
          <dd>{when(m.timestamp)}</dd>
        </dl>
      ) : (
        <p class="muted">Reading…</p>
      )}
    </Section>
  );
}

interface Snapshot {
  id: string;
  name: string | null;
  status: string;
  memory: boolean;
  size_bytes: number;
  created_at: string;
}

/** The machine's snapshots: take one (optionally named), start a new machine from one, delete one. */
function Snapshots({ id, running }: { id: string; running: boolean }) {
  const snaps = useLoad(async (signal) => ((await hasRoute("/v1/snapshots")) ? get<{ snapshots: Snapshot[] }>(`/v1/snapshots${q({ machine_id: id, limit: 100 })}`, signal) : null), [id]);
  const [error, run, busy] = useAction();
  const [name, setName] = useState("");
  if (snaps.data === null) {
    return (
      <Empty title="Snapshots are not available on this server">
        <p class="muted">This Kiln has no snapshot API yet.</p>
      </Empty>
    );
  }
  const take = () =>
    run(async () => {
      await api("POST", `/v1/machines/${enc(id)}/snapshots`, name.trim() ? { name: name.trim() } : {});
      setName("");
      snaps.reload();
    });
  return (
    <Section title="Snapshots">
      {running ? (
        <form
          class="inline-form"
          aria-label="Take a snapshot"
          onSubmit={(e) => {
            e.preventDefault();
            void take();
          }}
        >
          <label>
            Name (optional)
            <input value={name} maxLength={128} onInput={(e) => setName((e.target as HTMLInputElement).value)} />
          </label>
          <button type="submit" disabled={busy}>
            Take a snapshot
          </button>
        </form>
      ) : null}
      <ErrorNote error={snaps.error ?? error} />
      {snaps.data && snaps.data.snapshots.length === 0 ? (
        <Empty title="No snapshots of this machine">
          <p class="muted">A snapshot keeps this machine's files as of now while it goes on; start new machines from it later.</p>
        </Empty>
      ) : null}
      {snaps.data && snaps.data.snapshots.length > 0 ? (
        <table class="list" aria-label="Snapshots">
          <thead>
            <tr>
              <th>Snapshot</th>
              <th>Status</th>
              <th>Size</th>
              <th>Age</th>
              <th />
            </tr>
          </thead>
          <tbody>
            {snaps.data.snapshots.map((s) => (
              <tr data-snapshot={s.id}>
                <td>
                  {s.name ?? s.id} {s.name ? <span class="muted">{s.id}</span> : null}
                  {s.memory ? <span class="muted"> with memory</span> : null}
                </td>
                <td>
                  <Status value={s.status} />
                </td>
                <td>{bytes(s.size_bytes)}</td>
                <td title={when(s.created_at)}>{age(s.created_at)} ago</td>
                <td class="row-actions">
                  {s.status === "ready" ? (
                    <button
                      type="button"
                      disabled={busy}
                      onClick={() => run(async () => go("machines", (await api<Machine>("POST", "/v1/machines", { snapshot: s.id })).id))}
                    >
                      New machine
                    </button>
                  ) : null}
                  <ConfirmButton label="Delete" confirm="Really delete?" onConfirm={() => run(async () => (await api("DELETE", `/v1/snapshots/${enc(s.id)}`), snaps.reload()))} />
                </td>
              </tr>
            ))}
          </tbody>
        </table>
      ) : null}
    </Section>
  );
}
