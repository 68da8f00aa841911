# Everything installs itself: `make test` on a clean clone needs only Python 3.11, Java 17 and the
# Spanner emulator binary.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# pytest-xdist workers: more than the two cores, to fill the gaps their tests leave while they
# wait on stream time (heartbeats, workloads at a rate). Three instead of two: 3 min 18 s less.
# Four kept the cores busy but took a minute more than three: a test's running jobs spend CPU
# for as long as it lasts, and it lasts longer beside three others (bench/RESULTS.md, "The suite").
TEST_WORKERS ?= 3
STAMP := $(VENV)/.installed

.PHONY: run-spark venv jars spark-jars class-archive object-stores image test-base test-prerequisites test test-under-load lint run bench-reader bench-ingest bench-pipeline bench-snapshot bench-latency bench-mirror-size bench-width clean

venv: $(STAMP)

# What make fetches is kept in this user's cache, so a new clone takes it in a second: uv (below),
# the jars, MinIO. $(call into_cache,DIR,COMMAND): COMMAND makes DIR.new, which then replaces DIR
# whole, so two clones never share a half-made one.
CACHE := $(HOME)/.cache/spanner-delta-cdc
into_cache = rm -rf $(1).new && $(2) && rm -rf $(1) && mv $(1).new $(1)

# The venv by uv, a pinned copy installed once into a venv of its own in the cache: uv links the
# packages from its own cache instead of unpacking them (pip took 45-55 s a clone: resolving
# against the index, unpacking PySpark's jars, compiling). It installs from its cache alone first,
# and asks the index only when a package is missing there. The packages' bytecode and the
# product's are compiled here, as pip did for the packages: where PYTHONDONTWRITEBYTECODE is set
# (this machine's shells set it), every process would compile every module it imports again, and
# the suite ran far slower.
UV_VERSION := 0.13.9
UV_HOME := $(CACHE)/uv-$(UV_VERSION)
UV := $(UV_HOME)/bin/uv
$(UV):
	$(call into_cache,$(UV_HOME),$(PYTHON) -m venv $(UV_HOME).new \
	  && $(UV_HOME).new/bin/python -m pip install --quiet --disable-pip-version-check uv==$(UV_VERSION))

$(STAMP): pyproject.toml | $(UV)
	test -x $(PY) || $(UV) venv --quiet --python $(PYTHON) $(VENV)
	$(UV) pip install --quiet --python $(PY) --compile-bytecode --offline -e '.[test]' 2> /dev/null \
	  || $(UV) pip install --quiet --python $(PY) --compile-bytecode -e '.[test]'
	$(PY) -m compileall -q runtime ingest pipeline emulator examples tests bench > /dev/null
	touch $(STAMP)

jars: spark-jars class-archive
spark-jars: .jars/.fetched .jars/s3/.fetched
class-archive: .jars/spark-classes.jsa

# Fetched jars are kept in the cache, keyed by pipeline/session.py (which names them): a new clone
# copies them in a second instead of resolving them again through Spark and Maven Central (32 s
# on two cores). $(call cached,FOLDER,KEY): FOLDER's jars from the cache when there, else from
# the recipe's fetch that follows, then kept.
JARS_CACHE := $(CACHE)/jars-$(shell sha256sum pipeline/session.py | cut -c1-16)
cached = if [ -f $(JARS_CACHE)/$(2)/.fetched ]; then mkdir -p $(1) && $(call link,$(JARS_CACHE)/$(2)/*.jar,$(1)/); \
	else $(3) && $(call into_cache,$(JARS_CACHE)/$(2),mkdir -p $(JARS_CACHE)/$(2).new \
	&& $(call link,$(1)/*.jar,$(JARS_CACHE)/$(2).new/) && touch $(JARS_CACHE)/$(2).new/.fetched); fi
# Files hard-linked (one copy, and the same files the shared class archive below names), copied
# where the cache is on another filesystem; a file already there is replaced, never written into
# (it may be a link of the cached one).
link = { cp -l --remove-destination $(1) $(2) 2> /dev/null || cp --remove-destination $(1) $(2); }

# Delta jars for Spark, resolved once from Maven Central so nothing downloads at test or run time.
.jars/.fetched: $(STAMP) pipeline/session.py
	$(call cached,.jars,delta,$(PY) -m pipeline.session fetch .jars --no-class-archive)
	touch .jars/.fetched

# The class archive of Spark's driver (runtime/jvm.py): a driver started without it works, with
# more CPU. Made once per key in the cache, from a venv and jars of the cache's own, and
# hard-linked into each clone: a JVM maps an archive whose class path names other paths to the
# same files, which uv's links and the jars' above are (pipeline/class_archive.py). A clone it
# does not fit (the JVM says so at once) makes its own, from its own venv and jars, as each clone
# did before (about 50 CPU-s beside the first tests). Two clones wait on one lock to make it.
ARCHIVE_KEY := $(shell { cat pyproject.toml pipeline/session.py pipeline/class_archive.py \
	runtime/jvm.py; java -version 2>&1; } | sha256sum | cut -c1-16)
SHARED_ARCHIVE := $(CACHE)/class-archive-$(ARCHIVE_KEY)
.jars/spark-classes.jsa: .jars/.fetched pipeline/class_archive.py runtime/jvm.py
	mkdir -p $(CACHE) && flock $(CACHE)/.class-archive.lock \
	  $(MAKE) --no-print-directory $(SHARED_ARCHIVE)/.made || true
	$(PY) -m pipeline.class_archive reuse $(SHARED_ARCHIVE)/jars .jars \
	  || $(PY) -m pipeline.session fetch .jars --only-class-archive
	touch $@

# Where it was made stays in the cache: the archive names these paths, and a JVM checks them.
$(SHARED_ARCHIVE)/.made: | $(UV)
	rm -rf $(SHARED_ARCHIVE) && mkdir -p $(SHARED_ARCHIVE)/jars
	$(UV) venv --quiet --python $(PYTHON) $(SHARED_ARCHIVE)/venv
	$(UV) pip install --quiet --python $(SHARED_ARCHIVE)/venv/bin/python --offline \
	  -r pyproject.toml --extra test
	cp -l .jars/*.jar $(SHARED_ARCHIVE)/jars/
	PYTHONPATH=$(CURDIR) $(SHARED_ARCHIVE)/venv/bin/python -m pipeline.session fetch \
	  $(SHARED_ARCHIVE)/jars --only-class-archive
	touch $@

# S3A's jars into .jars/s3/, side by side with the above (they are not in the class archive).
.jars/s3/.fetched: $(STAMP) pipeline/session.py
	$(call cached,.jars/s3,s3,$(PY) -m pipeline.session fetch .jars --only-s3)
	touch .jars/s3/.fetched

# The object store for the tests, built from the Go module proxy once into .tools/ (like the
# jars): MinIO, the S3 API with conditional writes. (fake-gcs-server cannot take delta-rs's
# writes: emulator/NOTES.md, "Object stores".)
MINIO_MODULE := github.com/minio/minio@v0.0.0-20260212201848-7aac2a2c5b7c
TOOLS := $(CURDIR)/.tools/bin
object-stores: $(TOOLS)/minio

MINIO_CACHE := $(CACHE)/minio-$(lastword $(subst @, ,$(MINIO_MODULE)))

$(TOOLS)/minio: | $(MINIO_CACHE)/minio
	mkdir -p $(TOOLS) && cp $(MINIO_CACHE)/minio $@

# go install links MINIO_MODULE's binary in 8-9 s a clone, even with Go's build cache warm.
$(MINIO_CACHE)/minio:
	$(call into_cache,$(MINIO_CACHE),GOBIN=$(MINIO_CACHE).new GOFLAGS=-modcacherw \
	  go install -trimpath $(MINIO_MODULE))

# The repository's image, built as users build it (buildah's chroot isolation: a sandboxed
# builder) from a Debian base made with debootstrap once (deploy/test-base.sh), for the
# container tests (tests/test_image.py). Layers are cached: a code change rebuilds from the code.
IMAGE ?= localhost/spanner-delta-cdc:test
TEST_BASE ?= localhost/cdc-test-base:bookworm
CONTAINER_TOOLS := /usr/bin/buildah /usr/sbin/debootstrap
# One recipe makes both (a grouped target): under -j two copies of it would race for apt's lock.
$(CONTAINER_TOOLS) &:
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah debootstrap

test-base: $(CONTAINER_TOOLS)
	deploy/test-base.sh $(TEST_BASE)

image: test-base
	buildah bud --quiet --isolation chroot --layers --format docker \
		--build-arg PYTHON_IMAGE=$(TEST_BASE) \
		-t $(IMAGE) .

# What the tests need before they start, made side by side: the jars wait for the venv; MinIO
# waits for nothing of these. The checks (lint), the image and the class archive run beside the
# tests (below).
test-prerequisites: venv spark-jars object-stores

# `make test` builds the image and Spark's class archive beside the tests rather than before
# them: on a new machine the image takes minutes (debootstrap, then the image's apt, pip and
# Maven), and the archive a minute on every clone (a Delta job, then java -Xshare:dump), that the
# tests they do not concern need not wait for. A test that needs one waits for it while its build
# makes progress (the folder's log, status and pid; tests/background_builds.py): the image test,
# and the in-process Spark sessions, whose JVM must map the archive. The suite fails if a build
# failed. The checks (ruff, mypy: 10 s that the first tests need not wait for) print their log
# after the tests', and the suite fails if they did.
IMAGE_BUILD := .image-build
CLASS_ARCHIVE_BUILD := .class-archive-build
CHECKS := .checks
test:
	rm -rf $(IMAGE_BUILD) $(CLASS_ARCHIVE_BUILD) $(CHECKS) \
	  && mkdir -p $(IMAGE_BUILD) $(CLASS_ARCHIVE_BUILD) $(CHECKS)
	( $(MAKE) image > $(IMAGE_BUILD)/log 2>&1; echo $$? > $(IMAGE_BUILD)/status ) & \
	echo $$! > $(IMAGE_BUILD)/pid; \
	$(MAKE) -j4 --output-sync=target test-prerequisites \
	&& { ( $(MAKE) lint > $(CHECKS)/log 2>&1; echo $$? > $(CHECKS)/status ) & \
	     ( $(MAKE) class-archive > $(CLASS_ARCHIVE_BUILD)/log 2>&1; \
	       echo $$? > $(CLASS_ARCHIVE_BUILD)/status ) & \
	     echo $$! > $(CLASS_ARCHIVE_BUILD)/pid; \
	     $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15; }; \
	status=$$?; wait; \
	if [ -f $(CHECKS)/status ]; then \
	  cat $(CHECKS)/log; [ "$$(cat $(CHECKS)/status)" = 0 ] || status=1; fi; \
	exit $$status

# The suite with one core kept busy by a CPU-bound loop beside it: green on a loaded machine.
test-under-load:
	( while :; do :; done ) & load=$$!; \
	$(MAKE) test; status=$$?; kill $$load; exit $$status

lint: venv
	$(PY) -m ruff check runtime ingest pipeline emulator tests bench examples
	$(PY) -m mypy

# The whole product on one machine: emulator, sample database, workload, ingest service and
# pipeline for RUN_SECONDS, then a PASS/FAIL check of every mirror against Spanner.
RUN_SECONDS ?= 90
RUN_RATE ?= 20
run: venv jars
	$(PY) -m emulator.local_run --seconds $(RUN_SECONDS) --rate $(RUN_RATE)

# The same with the Spark source landing the change log on a loopback standalone cluster.
RUN_SPARK_WORKERS ?= 2
run-spark: venv jars
	$(PY) -m emulator.local_run --seconds $(RUN_SECONDS) --rate $(RUN_RATE) \
		--spark-cluster $(RUN_SPARK_WORKERS)

bench-reader: venv
	$(PY) bench/reader_throughput.py

bench-ingest: venv
	$(PY) bench/ingest_throughput.py

bench-pipeline: venv jars
	$(PY) bench/pipeline_throughput.py

bench-snapshot: venv jars
	$(PY) bench/snapshot_throughput.py

bench-latency: venv jars
	$(PY) bench/mirror_latency.py

bench-mirror-size: venv jars
	$(PY) bench/mirror_merge_scaling.py
	$(PY) bench/mirror_size_end_to_end.py

bench-width: venv
	$(PY) bench/decode_speed.py --records 3000 --repeats 5
	$(PY) bench/ingest_ceiling.py
	$(PY) bench/wide_reader.py

clean:
	rm -rf $(VENV) .jars .pytest_cache .hypothesis build *.egg-info
