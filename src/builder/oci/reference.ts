// Image references (`registry/repo:tag`, `…@sha256:…`) parsed into registry host, repository and tag or digest,
// with Docker Hub's short names (`python`, `user/app`) normalised the way docker does.

import { importError } from "./types.ts";

export interface ImageReference {
  /** Host (and port) requests go to: `registry-1.docker.io` for Docker Hub. */
  registry: string;
  repository: string;
  tag?: string;
  digest?: string;
}

export const DOCKER_HUB = "registry-1.docker.io";

const REPO_RE = /^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:\/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$/;
const TAG_RE = /^[\w][\w.-]{0,127}$/;
const DIGEST_RE = /^sha256:[a-f0-9]{64}$/;

export function parseReference(input: string): ImageReference {
  const raw = input.trim();
  if (!raw || raw.length > 512) throw importError(`image reference ${JSON.stringify(input)} is not valid`);
  let rest = raw;
  let digest: string | undefined;
  const at = rest.indexOf("@");
  if (at >= 0) {
    digest = rest.slice(at + 1);
    rest = rest.slice(0, at);
    if (!DIGEST_RE.test(digest)) throw importError(`image reference ${JSON.stringify(input)} has a digest that is not sha256:<64 hex>`);
  }
  let tag: string | undefined;
  const colon = rest.lastIndexOf(":");
  if (colon > rest.lastIndexOf("/")) {
    tag = rest.slice(colon + 1);
    rest = rest.slice(0, colon);
    if (!TAG_RE.test(tag)) throw importError(`image reference ${JSON.stringify(input)} has an invalid tag`);
  }
  const slash = rest.indexOf("/");
  const first = slash >= 0 ? rest.slice(0, slash) : "";
  let registry: string;
  let repository: string;
  if (first && (first.includes(".") || first.includes(":") || first === "localhost")) {
    registry = first;
    repository = rest.slice(slash + 1);
  } else {
    registry = DOCKER_HUB;
    repository = rest;
  }
  if (registry === "docker.io" || registry === "index.docker.io") registry = DOCKER_HUB;
  if (registry === DOCKER_HUB && !repository.includes("/")) repository = `library/${repository}`;
  if (!/^[A-Za-z0-9.-]+(:\d{1,5})?$/.test(registry)) throw importError(`image reference ${JSON.stringify(input)} has an invalid registry host`);
  if (!REPO_RE.test(repository)) throw importError(`image reference ${JSON.stringify(input)} has an invalid repository name`);
  if (!tag && !digest) tag = "latest";
  return { registry, repository, tag, digest };
}

export function formatReference(ref: ImageReference): string {
  return `${ref.registry}/${ref.repository}${ref.tag ? `:${ref.tag}` : ""}${ref.digest ? `@${ref.digest}` : ""}`;
}

/** The registry host a user names in credentials and KILN_INSECURE_REGISTRIES (`docker.io` for Docker Hub). */
export function sameRegistry(a: string, b: string): boolean {
  const norm = (h: string) => {
    const host = h.replace(/^https?:\/\//, "").replace(/\/.*$/, "").toLowerCase();
    return host === "docker.io" || host === "index.docker.io" ? DOCKER_HUB : host;
  };
  return norm(a) === norm(b);
}
