# kproxy — the two commands a new user runs: `make demo` and `make test`.
# Everything they need (venv, pinned pip packages, Kafka jars from Maven Central)
# is installed by the targets below, idempotently.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
KAFKA_LIBS := chaos/kafka/libs/.stamp
PYTEST_ARGS ?=

.PHONY: all setup kafka-jars test test-fast lint demo bench clean

all: setup

$(BIN)/.stamp: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,chaos,spark]'
	touch $@

$(KAFKA_LIBS): chaos/kafka/pom.xml
	mvn -q -B -f chaos/kafka/pom.xml package
	touch $@

setup: $(BIN)/.stamp $(KAFKA_LIBS)

kafka-jars: $(KAFKA_LIBS)

lint: setup
	$(BIN)/lint-imports

# Everything: unit, property, integration (real Kafka), drills, Spark.
# pytest's exit 5 (no test collected) fails the target like any other non-zero exit.
test: setup lint
	@$(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; fi; exit $$rc

# The quick subset for a developer loop.
test-fast: setup
	$(BIN)/python -m pytest -m "unit" $(PYTEST_ARGS)

demo: setup
	$(BIN)/kproxy demo

bench: setup
	$(BIN)/kproxy bench proxy --json

clean:
	rm -rf $(VENV) chaos/kafka/libs chaos/kafka/target
