// Machines: every live machine with status, template, host and age (the first page of 100 on screen at once, the
// rest read behind it and rendered together), a create form, and destroy. The empty state says how to make the first one.

import { Component } from "preact";
import { useEffect, useMemo, useState } from "preact/hooks";
import { allPages, api, getEarly, type Machine, type Template } from "../api.ts";
import { go, href } from "../router.ts";
import { age, ConfirmButton, Empty, ErrorNote, Section, Status, useAction } from "../ui.tsx";

export const TEMPLATES_PATH = "/v1/templates";

/** Template id → its canonical ref (empty when the list cannot be read: rows show the id). */
export async function templateNames(signal?: AbortSignal): Promise<Map<string, string>> {
  try {
    const body = await getEarly<{ templates: Template[] }>(TEMPLATES_PATH, signal);
    return new Map(body.templates.map((t) => [t.template_id, t.canonical_ref]));
  } catch {
    return new Map();
  }
}

export function useTemplateNames(): Map<string, string> {
  const [names, setNames] = useState(new Map<string, string>());
  useEffect(() => {
    const ctl = new AbortController();
    templateNames(ctl.signal).then((m) => !ctl.signal.aborted && setNames(m));
    return () => ctl.abort();
  }, []);
  return names;
}

/**
 * One page of the list as its own fixed-layout table in a `content-visibility: auto` block: appending a page renders
 * only its own rows, and the browser lays out and paints only the blocks near the screen (the rest when scrolled to;
 * they are in the page all along, for find-in-page too). Laying out all 500 rows of one table was most of the view's
 * first paint. Every block has the same columns as the header's table, so they line up.
 */
class RowGroup extends Component<{ rows: Machine[]; templates: Map<string, string>; now: number; onGone: (id: string) => void }> {
  shouldComponentUpdate(next: RowGroup["props"]) {
    return next.rows !== this.props.rows || next.templates !== this.props.templates;
  }
  render() {
    const { rows, templates, now, onGone } = this.props;
    return (
      <div class="rows-block">
        <table class="list" role="rowgroup">
          <Columns />
          <tbody role="none">
            {rows.map((m) => (
              <MachineRow key={m.id} m={m} template={templates.get(m.template_id) ?? m.template_id} now={now} onGone={() => onGone(m.id)} />
            ))}
          </tbody>
        </table>
      </div>
    );
  }
}

function Columns() {
  return (
    <colgroup>
      <col class="col-machine" />
      <col class="col-status" />
      <col class="col-template" />
      <col class="col-host" />
      <col class="col-age" />
      <col class="col-actions" />
    </colgroup>
  );
}

export function Machines() {
  const [pages, setPages] = useState<Machine[][]>([]);
  const machines = useMemo(() => pages.flat(), [pages]);
  const [state, setState] = useState<{ loading: boolean; error?: Error }>({ loading: true });
  const [tick, setTick] = useState(0);
  const [filter, setFilter] = useState("");
  const [templates, setTemplates] = useState(new Map<string, string>());

  useEffect(() => {
    const ctl = new AbortController();
    let acc: Machine[][] = [];
    const first = tick === 0;
    setState((s) => ({ ...s, loading: first }));
    // Read beside the first page (both are prefetched while the page boots), and shown with it: names arriving
    // after the rows would render every row again.
    const names = templateNames(ctl.signal);
    // The first load shows the first page as soon as it arrives and the rest together once read (rendering between
    // pages held each next request behind a render); a refresh swaps the whole list in once it has every page.
    allPages<Machine>("/v1/machines", "machines", async (page, done) => {
      acc = [...acc, page];
      if (first && acc.length === 1) setTemplates(await names);
      if ((first && acc.length === 1) || done) setPages(acc);
      if (done) setState({ loading: false });
      // bench/console.bench.ts reads these marks.
      if (first && acc.length === 1) performance.mark("kiln:machines-first-page");
      if (first && done) performance.mark("kiln:machines-all");
    }, { signal: ctl.signal }).catch((error: Error) => !ctl.signal.aborted && setState({ loading: false, error }));
    if (!first) void names.then((m) => !ctl.signal.aborted && setTemplates(m));
    // Statuses change (creates finish, timeouts destroy): the list is read again every 10 s while shown.
    const timer = setTimeout(() => setTick((t) => t + 1), 10_000);
    return () => {
      ctl.abort();
      clearTimeout(timer);
    };
  }, [tick]);

  const shown = useMemo(() => {
    const f = filter.trim().toLowerCase();
    if (!f) return machines;
    return machines.filter((m) => [m.id, m.name ?? "", m.status, templates.get(m.template_id) ?? m.template_id, m.host_id ?? ""].some((v) => v.toLowerCase().includes(f)));
  }, [machines, filter, templates]);
  const now = Date.now();
  const gone = (id: string) => setPages((all) => all.map((rows) => (rows.some((m) => m.id === id) ? rows.filter((m) => m.id !== id) : rows)));

  return (
    <>
      <CreateMachine templates={templates} onCreated={(m) => go("machines", m.id)} />
      <Section
        title={`Machines${state.loading ? "" : ` (${machines.length})`}`}
        actions={
          <>
            <input data-filter type="search" placeholder="Filter  ( / )" aria-label="Filter machines" value={filter} onInput={(e) => setFilter((e.target as HTMLInputElement).value)} />
            <button type="button" onClick={() => setTick((t) => t + 1)}>
              Refresh
            </button>
          </>
        }
      >
        <ErrorNote error={state.error} />
        {!state.loading && machines.length === 0 && !state.error ? (
          <Empty title="No machines yet">
            <p>
              Create one with the form above: the default template <code>local/base</code> is Debian with Python, git and a shell. Then open it for a
              terminal and its files.
            </p>
            <p class="muted">
              From a shell: <code>bin/kiln machines create</code>, or <code>POST /v1/machines</code> with your key.
            </p>
          </Empty>
        ) : (
          <div class="blocks" role="table" aria-label="Machines">
            <table class="list" role="rowgroup">
              <Columns />
              <thead role="none">
                <tr>
                  <th>Machine</th>
                  <th>Status</th>
                  <th>Template</th>
                  <th>Host</th>
                  <th>Age</th>
                  <th />
                </tr>
              </thead>
            </table>
            {(filter.trim() ? [shown] : pages).map((rows, i) => (
              <RowGroup key={filter.trim() ? "filtered" : i} rows={rows} templates={templates} now={now} onGone={gone} />
            ))}
          </div>
        )}
        {state.loading ? <p class="muted">Loading…</p> : null}
      </Section>
    </>
  );
}

function MachineRow({ m, template, now, onGone }: { m: Machine; template: string; now: number; onGone: () => void }) {
  const [error, run] = useAction();
  return (
    <tr data-machine={m.id}>
      <td>
        <a href={href("machines", m.id)}>{m.name ? <>{m.name} <span class="muted">{m.id}</span></> : m.id}</a>
        {error ? <div class="error">{error.message}</div> : null}
      </td>
      <td>
        <Status value={m.status} />
      </td>
      <td>{template}</td>
      <td>{m.host_id ?? "this host"}</td>
      <td title={m.created_at}>{age(m.created_at, now)}</td>
      <td class="row-actions">
        <ConfirmButton label="Destroy" confirm="Really destroy?" onConfirm={() => run(async () => (await api("DELETE", `/v1/machines/${m.id}`), onGone()))} />
      </td>
    </tr>
  );
}

function CreateMachine({ templates, onCreated }: { templates: Map<string, string>; onCreated: (m: Machine) => void }) {
  const [template, setTemplate] = useState("local/base");
  const [timeout, setTimeoutS] = useState("600");
  const [name, setName] = useState("");
  const [error, run, busy] = useAction();
  const submit = (e: Event) => {
    e.preventDefault();
    void run(async () => {
      const body: Record<string, unknown> = { template: template.trim() || "local/base", timeout_s: Number(timeout) || 300 };
      if (name.trim()) body.name = name.trim();
      onCreated(await api<Machine>("POST", "/v1/machines", body));
    });
  };
  return (
    <form class="inline-form" onSubmit={submit} aria-label="Create a machine">
      <label>
        Template
        <input list="template-refs" value={template} onInput={(e) => setTemplate((e.target as HTMLInputElement).value)} required />
      </label>
      <datalist id="template-refs">
        {[...new Set(templates.values())].map((ref) => (
          <option value={ref} />
        ))}
      </datalist>
      <label>
        Name
        <input value={name} placeholder="optional" onInput={(e) => setName((e.target as HTMLInputElement).value)} />
      </label>
      <label>
        Timeout (s)
        <input type="number" min={1} value={timeout} onInput={(e) => setTimeoutS((e.target as HTMLInputElement).value)} />
      </label>
      <button type="submit" disabled={busy}>
        {busy ? "Creating…" : "Create machine"}
      </button>
      <ErrorNote error={error} />
    </form>
  );
}
