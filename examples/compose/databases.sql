-- Runs before init.sql (mounted as /docker-entrypoint-initdb.d/00-databases.sql):
-- the database that holds reclock's remap store (the bindings) and the
-- pipeline's PostgreSQL outputs, apart from the captured "shop" database.
CREATE DATABASE reclock;
