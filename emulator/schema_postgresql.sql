-- Sample database, PostgreSQL dialect: the same tables and streams as the GoogleSQL file.
CREATE TABLE accounts (
  account_id bigint NOT NULL,
  owner varchar NOT NULL,
  balance bigint NOT NULL,
  updated_at timestamptz,
  PRIMARY KEY (account_id)
);

CREATE TABLE transfers (
  from_account_id bigint NOT NULL,
  transfer_id varchar(36) NOT NULL,
  to_account_id bigint NOT NULL,
  amount bigint NOT NULL,
  created_at timestamptz NOT NULL,
  PRIMARY KEY (from_account_id, transfer_id)
);

CREATE TABLE all_types (
  id bigint NOT NULL,
  variant varchar(32) NOT NULL,
  col_int64 bigint,
  col_float64 float8,
  col_float32 float4,
  col_bool boolean,
  col_string varchar,
  col_bytes bytea,
  col_date date,
  col_timestamp timestamptz,
  col_numeric numeric,
  col_json jsonb,
  col_int64_array bigint[],
  col_string_array varchar[],
  col_float64_array float8[],
  PRIMARY KEY (id, variant)
);

CREATE CHANGE STREAM all_changes FOR ALL
  WITH (value_capture_type = 'NEW_ROW_AND_OLD_VALUES', retention_period = '1d');

CREATE CHANGE STREAM account_balances FOR accounts(balance)
  WITH (value_capture_type = 'NEW_VALUES');

-- Spanner's default options (OLD_AND_NEW_VALUES). Not FOR ALL: Spanner lets at most three
-- streams watch a table, and accounts has two.
CREATE CHANGE STREAM default_changes FOR transfers, all_types;
