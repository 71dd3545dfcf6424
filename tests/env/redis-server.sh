#!/usr/bin/env bash
# The resp L2 tier tests start a real redis-server ($REDIS_SERVER or PATH). When it is
# missing and we run as root with apt-get (CI's Debian box), install the distribution's
# package, quietly; anywhere else, or when the install fails, those tests skip and say why.
# Never fails the run.
if [ -n "${REDIS_SERVER:-}" ] || command -v redis-server >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "== redis-server not found: the resp L2 tier tests skip (Debian: apt-get install redis-server)"
  exit 0
fi
echo "== install redis-server for the resp L2 tier tests"
install() {
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server \
    >/dev/null 2>&1
}
install || { apt-get update -qq >/dev/null 2>&1 && install; } \
  || echo "   apt-get could not install redis-server: the resp L2 tier tests skip"
exit 0
