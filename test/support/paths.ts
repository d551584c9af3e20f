// Where tests keep what they share across files and runs: the base template is made once here.

export const TEST_CACHE_DIR = process.env.KILN_TEST_CACHE_DIR || "/var/tmp/kiln-test-cache";
