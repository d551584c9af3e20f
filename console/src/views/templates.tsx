// Templates and their build history: every logical template with its tags and aliases, then one template's
// builds (newest first) leading to each build's live log.

import { enc, get, type Build, type Template } from "../api.ts";
import { href } from "../router.ts";
import { age, Empty, ErrorNote, Section, Status, useLoad } from "../ui.tsx";

export function Templates() {
  const list = useLoad((signal) => get<{ templates: Template[] }>("/v1/templates", signal), []);
  const templates = list.data?.templates ?? [];
  return (
    <Section title="Templates">
      <ErrorNote error={list.error} />
      {list.data && templates.length === 0 ? (
        <Empty title="No templates yet">
          <p>
            The base template <code>local/base</code> appears once the server has made it (about a minute on first start). Build your own with{" "}
            <code>POST /v1/templates/build</code> or <code>bin/kiln templates build</code>; its build log shows here live.
          </p>
        </Empty>
      ) : (
        <table class="list" aria-label="Templates">
          <thead>
            <tr>
              <th>Template</th>
              <th>Tags</th>
              <th>Aliases</th>
              <th>Updated</th>
            </tr>
          </thead>
          <tbody>
            {templates.map((t) => (
              <tr>
                <td>
                  <a href={href("templates", t.template_id)}>{t.canonical_ref}</a>
                </td>
                <td>{Object.keys(t.tags).join(", ") || "—"}</td>
                <td>{t.aliases.join(", ") || "—"}</td>
                <td>{age(t.updated_at)} ago</td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
    </Section>
  );
}

export function TemplatePage({ id }: { id: string }) {
  const template = useLoad((signal) => get<Template>(`/v1/templates/${enc(id)}`, signal), [id]);
  // A build still running changes status: the history is read again every few seconds.
  const builds = useLoad((signal) => get<{ builds: Build[] }>(`/v1/templates/${enc(id)}/builds?limit=100`, signal), [id], 3000);
  return (
    <Section
      title={
        <>
          <a href={href("templates")}>Templates</a> / {template.data?.canonical_ref ?? id}
        </>
      }
    >
      <ErrorNote error={template.error ?? builds.error} />
      {builds.data && builds.data.builds.length === 0 ? <Empty title="No builds recorded for this template" /> : null}
      {builds.data && builds.data.builds.length > 0 ? (
        <table class="list" aria-label="Builds">
          <thead>
            <tr>
              <th>Build</th>
              <th>Status</th>
              <th>Source</th>
              <th>Backend</th>
              <th>Tags</th>
              <th>Started</th>
              <th>Took</th>
            </tr>
          </thead>
          <tbody>
            {builds.data.builds.map((b) => (
              <tr data-build={b.build_id}>
                <td>
                  <a href={href("templates", id, "builds", b.build_id)}>{b.build_id}</a>
                </td>
                <td>
                  <Status value={b.status} />
                  {b.failure_phase ? <span class="muted"> in {b.failure_phase}</span> : null}
                </td>
                <td>{b.source_type}</td>
                <td>{b.build_backend}</td>
                <td>{b.tags.join(", ")}</td>
                <td>{age(b.started_at ?? b.created_at)} ago</td>
                <td>{b.duration_ms ? `${(b.duration_ms / 1000).toFixed(1)} s` : "—"}</td>
              </tr>
            ))}
          </tbody>
        </table>
      ) : null}
    </Section>
  );
}
