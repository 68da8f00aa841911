#!/bin/sh
# The Python base the image's tests build on: what python:3.11-slim-bookworm gives (python,
# venv, CA certificates), made with debootstrap from Debian's packages, since no registry is
# reached here. The build host's extra CA certificates are trusted in it: pip and Maven inside
# a build reach the registries through them. Made once, reused while it exists.
#   deploy/test-base.sh localhost/cdc-test-base:bookworm
set -eu
name=$1
if buildah inspect --type image "$name" >/dev/null 2>&1; then
  exit 0
fi
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
  bookworm "$root" http://deb.debian.org/debian
for certificate in /usr/local/share/ca-certificates/*.crt; do
  if [ -f "$certificate" ]; then cp "$certificate" "$root/usr/local/share/ca-certificates/"; fi
done
chroot "$root" update-ca-certificates >/dev/null
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
container=$(buildah from scratch)
mount=$(buildah mount "$container")
cp -a "$root"/. "$mount"/
buildah umount "$container" >/dev/null
buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --cmd '["python3"]' "$container"
buildah commit --quiet --rm "$container" "$name"
