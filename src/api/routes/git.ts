// Git in a machine (tag Git): SPEC.md's push, and clone, pull, fetch, status, add, commit, branches, checkout.
// Credentials ride in `auth` per operation; they are validated by kind in the git service and never stored.

import { Type } from "typebox";
import type { TSchema } from "typebox";
import type { App } from "../app-type.ts";
import type { Services } from "../../services/index.ts";
import { GIT_AUTH_KINDS, GIT_DEFAULT_REMOTE } from "../../git/service.ts";
import { errors, Id, MachinePath, UserName } from "../schemas.ts";
import { abortOnClientGone } from "./client-gone.ts";

const Params = Type.Object({ id: Id });

/** SPEC.md's git credentials object. Which fields a kind needs is checked by the service (400 when missing). */
const GitAuth = Type.Object(
  {
    kind: Type.Enum(GIT_AUTH_KINDS),
    username: Type.Optional(Type.String({ minLength: 1, maxLength: 1024, description: "HTTPS username (or token); required when kind=https" })),
    password: Type.Optional(Type.String({ minLength: 1, maxLength: 8192, description: "HTTPS password or token; required when kind=https" })),
    private_key: Type.Optional(Type.String({ minLength: 1, maxLength: 65536, description: "SSH private key material; required when kind=ssh" })),
    passphrase: Type.Optional(Type.String({ maxLength: 4096, description: "SSH key passphrase" })),
  },
  { additionalProperties: false, description: "Per-operation credentials, placed in a scratch directory that lives only for the operation" },
);

/** A branch or remote name: no leading '-', no whitespace or control characters (git refuses the rest itself). */
const RefName = Type.String({ minLength: 1, maxLength: 1024, pattern: "^[^\\s\\-][^\\s]*$" });
const TimeoutS = Type.Integer({ minimum: 1, maximum: 3600, description: "Bound on the whole operation; default 120" });

const common = { path: MachinePath, user: Type.Optional(UserName), timeout_s: Type.Optional(TimeoutS) };
const body = (fields: Record<string, TSchema>) => Type.Object({ ...common, ...fields }, { additionalProperties: false });

const GitPushRequest = body({
  remote: Type.Optional({ ...RefName, default: GIT_DEFAULT_REMOTE }),
  branch: Type.Optional(RefName),
  set_upstream: Type.Optional(Type.Boolean({ default: false })),
  auth: Type.Optional(GitAuth),
});
const Summary = Type.Object({ summary: Type.String({ description: "Human-readable summary emitted by git" }) });

const StatusFile = Type.Object({
  path: Type.String(),
  index: Type.String(),
  worktree: Type.String(),
  status: Type.String(),
  original_path: Type.Optional(Type.String()),
});
const GitStatus = Type.Object({
  branch: Type.Union([Type.String(), Type.Null()]),
  detached: Type.Boolean(),
  commit: Type.Union([Type.String(), Type.Null()]),
  upstream: Type.Union([Type.String(), Type.Null()]),
  ahead: Type.Integer(),
  behind: Type.Integer(),
  clean: Type.Boolean(),
  files: Type.Array(StatusFile),
});

export async function gitRoutes(app: App, opts: { services: Services }) {
  const { git } = opts.services;
  const tags = ["Git"];
  const gitErrors = errors(400, 404, 409, 422);

  app.post(
    "/v1/machines/:id/git/push",
    { config: { auth: "key" }, schema: { tags, summary: "Push to a remote", params: Params, body: GitPushRequest, response: { 200: Summary, ...gitErrors } } },
    async (req, reply) => git.push(req.params.id, req.body as Parameters<typeof git.push>[1], abortOnClientGone(reply)),
  );

  app.post(
    "/v1/machines/:id/git/clone",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Clone a repository into path",
        params: Params,
        body: body({ url: Type.String({ minLength: 1, maxLength: 4096 }), branch: Type.Optional(RefName), depth: Type.Optional(Type.Integer({ minimum: 1, maximum: 1_000_000 })), auth: Type.Optional(GitAuth) }),
        response: { 200: Type.Object({ path: Type.String(), branch: Type.Union([Type.String(), Type.Null()]), commit: Type.Union([Type.String(), Type.Null()]), summary: Type.String() }), ...gitErrors },
      },
    },
    async (req, reply) => git.clone(req.params.id, req.body as Parameters<typeof git.clone>[1], abortOnClientGone(reply)),
  );

  app.post(
    "/v1/machines/:id/git/pull",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Fetch and merge (or rebase) from a remote; without remote and branch, from the upstream",
        params: Params,
        body: body({ remote: Type.Optional(RefName), branch: Type.Optional(RefName), rebase: Type.Optional(Type.Boolean({ default: false })), auth: Type.Optional(GitAuth) }),
        response: { 200: Summary, ...gitErrors },
      },
    },
    async (req, reply) => git.pull(req.params.id, req.body as Parameters<typeof git.pull>[1], abortOnClientGone(reply)),
  );

  app.post(
    "/v1/machines/:id/git/fetch",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Fetch from a remote",
        params: Params,
        body: body({ remote: Type.Optional(RefName), prune: Type.Optional(Type.Boolean({ default: false })), auth: Type.Optional(GitAuth) }),
        response: { 200: Summary, ...gitErrors },
      },
    },
    async (req, reply) => git.fetch(req.params.id, req.body as Parameters<typeof git.fetch>[1], abortOnClientGone(reply)),
  );

  app.post(
    "/v1/machines/:id/git/status",
    { config: { auth: "key" }, schema: { tags, summary: "Branch, ahead/behind its upstream, and changed files", params: Params, body: body({}), response: { 200: GitStatus, ...gitErrors } } },
    async (req) => git.status(req.params.id, req.body as Parameters<typeof git.status>[1]),
  );

  app.post(
    "/v1/machines/:id/git/add",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Stage files (all changes when files is absent); answers the status after",
        params: Params,
        body: body({ files: Type.Optional(Type.Array(Type.String({ minLength: 1, maxLength: 4096 }), { minItems: 1, maxItems: 10000 })) }),
        response: { 200: GitStatus, ...gitErrors },
      },
    },
    async (req) => git.add(req.params.id, req.body as Parameters<typeof git.add>[1]),
  );

  app.post(
    "/v1/machines/:id/git/commit",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Commit what is staged",
        params: Params,
        body: body({
          message: Type.String({ minLength: 1, maxLength: 1_000_000 }),
          author_name: Type.Optional(Type.String({ minLength: 1, maxLength: 256 })),
          author_email: Type.Optional(Type.String({ minLength: 1, maxLength: 256 })),
          allow_empty: Type.Optional(Type.Boolean({ default: false })),
        }),
        response: {
          200: Type.Object({ sha: Type.String(), branch: Type.Union([Type.String(), Type.Null()]), author_name: Type.String(), author_email: Type.String(), message: Type.String() }),
          ...gitErrors,
        },
      },
    },
    async (req) => git.commit(req.params.id, req.body as Parameters<typeof git.commit>[1]),
  );

  app.post(
    "/v1/machines/:id/git/branches",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Local branches",
        params: Params,
        body: body({}),
        response: {
          200: Type.Object({
            current: Type.Union([Type.String(), Type.Null()]),
            branches: Type.Array(Type.Object({ name: Type.String(), current: Type.Boolean(), commit: Type.String(), upstream: Type.Union([Type.String(), Type.Null()]) })),
          }),
          ...gitErrors,
        },
      },
    },
    async (req) => git.branches(req.params.id, req.body as Parameters<typeof git.branches>[1]),
  );

  app.post(
    "/v1/machines/:id/git/checkout",
    {
      config: { auth: "key" },
      schema: {
        tags,
        summary: "Switch to a branch (create makes it from HEAD)",
        params: Params,
        body: body({ branch: RefName, create: Type.Optional(Type.Boolean({ default: false })) }),
        response: { 200: Type.Object({ branch: Type.Union([Type.String(), Type.Null()]), commit: Type.Union([Type.String(), Type.Null()]), detached: Type.Boolean() }), ...gitErrors },
      },
    },
    async (req) => git.checkout(req.params.id, req.body as Parameters<typeof git.checkout>[1]),
  );
}
