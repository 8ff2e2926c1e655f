-- Demo tables of the compose deployment's "shop" database.
--
-- The postgres service runs this file once, when its data volume is first
-- initialised (mounted into /docker-entrypoint-initdb.d, executed by psql in
-- the POSTGRES_DB database, "shop"). Plain SQL only, so the tests can run it
-- as is. examples/compose/producer.py writes to these tables; the pipeline's
-- "shop" source captures them through logical replication (pgoutput).
--
-- Both tables have a primary key and REPLICA IDENTITY FULL: every update and
-- delete carries the whole old row, so the CDC outputs are diff logs (an
-- update retracts the old row and inserts the new one).

CREATE TABLE IF NOT EXISTS customers (
    id          bigint PRIMARY KEY,
    name        text NOT NULL,
    email       text NOT NULL,
    tier        text NOT NULL DEFAULT 'basic',
    updated_at  timestamptz NOT NULL DEFAULT now()
);
ALTER TABLE customers REPLICA IDENTITY FULL;

CREATE TABLE IF NOT EXISTS orders (
    id           bigint PRIMARY KEY,
    customer_id  bigint NOT NULL REFERENCES customers (id),
    amount       numeric(12, 2) NOT NULL,
    status       text NOT NULL DEFAULT 'new',
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now()
);
ALTER TABLE orders REPLICA IDENTITY FULL;
CREATE INDEX IF NOT EXISTS orders_customer_id ON orders (customer_id);
