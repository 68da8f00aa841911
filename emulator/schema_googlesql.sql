-- Sample database, GoogleSQL dialect. Names are snake_case so one workload serves both dialects.
CREATE TABLE accounts (
  account_id INT64 NOT NULL,
  owner STRING(MAX) NOT NULL,
  balance INT64 NOT NULL,
  updated_at TIMESTAMP,
) PRIMARY KEY (account_id);

CREATE TABLE transfers (
  from_account_id INT64 NOT NULL,
  transfer_id STRING(36) NOT NULL,
  to_account_id INT64 NOT NULL,
  amount INT64 NOT NULL,
  created_at TIMESTAMP NOT NULL,
) PRIMARY KEY (from_account_id, transfer_id);

CREATE TABLE all_types (
  id INT64 NOT NULL,
  variant STRING(32) NOT NULL,
  col_int64 INT64,
  col_float64 FLOAT64,
  col_float32 FLOAT32,
  col_bool BOOL,
  col_string STRING(MAX),
  col_bytes BYTES(MAX),
  col_date DATE,
  col_timestamp TIMESTAMP,
  col_numeric NUMERIC,
  col_json JSON,
  col_int64_array ARRAY<INT64>,
  col_string_array ARRAY<STRING(MAX)>,
  col_float64_array ARRAY<FLOAT64>,
) PRIMARY KEY (id, variant);

CREATE CHANGE STREAM all_changes FOR ALL
  OPTIONS (value_capture_type = 'NEW_ROW_AND_OLD_VALUES', retention_period = '1d');

CREATE CHANGE STREAM account_balances FOR accounts(balance)
  OPTIONS (value_capture_type = 'NEW_VALUES');

-- Spanner's default options (OLD_AND_NEW_VALUES). Not FOR ALL: Spanner lets at most three
-- streams watch a table, and accounts has two.
CREATE CHANGE STREAM default_changes FOR transfers, all_types;
