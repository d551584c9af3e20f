// Hash routes (#/machines/mch_…): the server serves one page, and ids never leave the browser in a request path
// to /console. `useRoute` re-renders on navigation.

import { useEffect, useState } from "preact/hooks";

export function currentPath(): string[] {
  const hash = location.hash.replace(/^#\/?/, "");
  return hash.split("/").filter(Boolean).map(decodeURIComponent);
}

export function useRoute(): string[] {
  const [path, setPath] = useState(currentPath());
  useEffect(() => {
    const update = () => setPath(currentPath());
    window.addEventListener("hashchange", update);
    return () => window.removeEventListener("hashchange", update);
  }, []);
  return path;
}

export function href(...parts: string[]): string {
  return "#/" + parts.map(encodeURIComponent).join("/");
}

export function go(...parts: string[]) {
  location.hash = href(...parts);
}
