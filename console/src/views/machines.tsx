// Machines: every live machine with status, template, host and age (pages of 100 rendered as they arrive), a
// create form, and destroy. The empty state says how to make the first one.

import { Component } from "preact";
import { useEffect, useMemo, useState } from "preact/hooks";
import { allPages, api, get, type Machine, type Template } from "../api.ts";
import { go, href } from "../router.ts";
import { age, ConfirmButton, Empty, ErrorNote, Section, Status, useAction } from "../ui.tsx";

export function useTemplateNames(): Map<string, string> {
  const [names, setNames] = useState(new Map<string, string>());
  useEffect(() => {
    const ctl = new AbortController();
    get<{ templates: Template[] }>("/v1/templates", ctl.signal).then(
      (body) => setNames(new Map(body.templates.map((t) => [t.template_id, t.canonical_ref]))),
      () => undefined,
    );
    return () => ctl.abort();
  }, []);
  return names;
}

/**
 * Rows of one page of the list: appending a page renders only its own rows, not every row again (500 machines
 * arrive as five pages, and re-rendering the growing table for each was most of the view's first paint).
 */
class RowGroup extends Component<{ rows: Machine[]; templates: Map<string, string>; now: number; onGone: (id: string) => void }> {
  shouldComponentUpdate(next: RowGroup["props"]) {
    return next.rows !== this.props.rows || next.templates !== this.props.templates;
  }
  render() {
    const { rows, templates, now, onGone } = this.props;
    return rows.map((m) => <MachineRow key={m.id} m={m} template={templates.get(m.template_id) ?? m.template_id} now={now} onGone={() => onGone(m.id)} />);
  }
}

export function Machines() {
  const [pages, setPages] = useState<Machine[][]>([]);
  const machines = useMemo(() => pages.flat(), [pages]);
  const [state, setState] = useState<{ loading: boolean; error?: Error }>({ loading: true });
  const [tick, setTick] = useState(0);
  const [filter, setFilter] = useState("");
  const templates = useTemplateNames();

  useEffect(() => {
    const ctl = new AbortController();
    let acc: Machine[][] = [];
    const first = tick === 0;
    setState((s) => ({ ...s, loading: first }));
    // The first load shows each page as it arrives; a refresh swaps the whole list in once it has every page.
    allPages<Machine>("/v1/machines", "machines", (page, done) => {
      acc = [...acc, page];
      if (first || done) setPages(acc);
      if (done) setState({ loading: false });
      // The first page is on screen: bench/console.bench.ts waits on these marks.
      if (first && acc.length === 1) performance.mark("kiln:machines-first-page");
      if (first && done) performance.mark("kiln:machines-all");
    }, { signal: ctl.signal }).catch((error: Error) => !ctl.signal.aborted && setState({ loading: false, error }));
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
          <table class="list" aria-label="Machines">
            <thead>
              <tr>
                <th>Machine</th>
                <th>Status</th>
                <th>Template</th>
                <th>Host</th>
                <th>Age</th>
                <th />
              </tr>
            </thead>
            <tbody>
              {(filter.trim() ? [shown] : pages).map((rows, i) => (
                <RowGroup key={filter.trim() ? "filtered" : i} rows={rows} templates={templates} now={now} onGone={gone} />
              ))}
            </tbody>
          </table>
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
