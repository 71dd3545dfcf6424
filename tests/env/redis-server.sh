#!/usr/bin/env bash
# The resp L2 tier tests start a real redis-server ($REDIS_SERVER or PATH). When it is
# missing and we run as root with apt-get (CI's Debian box), install the distribution's
# package, quietly. Where it stays missing, those tests skip on the patched build and say
# why; the pristine arm counts a skipped fix test as an error. When CI is set (CI's box),
# a redis-server that cannot be had fails the run here, naming the cause.
fail_or_skip() {
  if [ -n "${CI:-}" ]; then
    echo "== FAILED: $1; CI is set, and the resp L2 tier tests need it" >&2
    exit 1
  fi
  echo "== $1: the resp L2 tier tests skip (Debian: apt-get install redis-server)"
  exit 0
}
if [ -n "${REDIS_SERVER:-}" ]; then
  [ -x "$REDIS_SERVER" ] || fail_or_skip "REDIS_SERVER=$REDIS_SERVER is not an executable"
  exit 0
fi
if command -v redis-server >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  fail_or_skip "redis-server not found, and no apt-get as root to install it"
fi
echo "== install redis-server for the resp L2 tier tests"
install() {
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server \
    >/dev/null 2>&1
}
install || { apt-get update -qq >/dev/null 2>&1 && install; } \
  || fail_or_skip "apt-get could not install redis-server"
command -v redis-server >/dev/null 2>&1 || fail_or_skip "redis-server installed but not on PATH"
exit 0
