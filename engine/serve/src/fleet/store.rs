//! etcd, through the `etcd-client` crate: runs the fleet protocol's transactions ([`strata_fleet::Txn`]) and
//! reads its keys ([`strata_fleet::KeyValue`]), and keeps a node's lease. Every call is bounded by the store's
//! timeout, so that an etcd that does not answer (a lost quorum, a partition) is an error, never a hang.

use std::time::Duration;

use etcd_client::{Client, CompareOp, ConnectOptions, GetOptions, PutOptions, TxnOp};
use strata_fleet::{Compare, KeyValue, Op, Txn};

use super::FleetError;

/// The pause before a call that found a member unreachable is tried again.
const RETRY_PAUSE: Duration = Duration::from_millis(50);

/// gRPC's `UNAVAILABLE`, which the client answers when the member it picked cannot be reached.
fn tonic_code_unavailable() -> tonic::Code {
    tonic::Code::Unavailable
}

/// A connection to the fleet's etcd cluster.
#[derive(Clone)]
pub struct Store {
    client: Client,
    timeout: Duration,
    endpoints: String,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("endpoints", &self.endpoints).finish_non_exhaustive()
    }
}

impl Store {
    /// Connects to the cluster at `endpoints` (`http://host:port`, or `https://` with `tls`: mutual TLS); each
    /// request gives up after `timeout`.
    pub async fn connect(
        endpoints: &[String],
        timeout: Duration,
        tls: Option<etcd_client::TlsOptions>,
    ) -> Result<Store, FleetError> {
        let joined = endpoints.join(",");
        let mut options = ConnectOptions::new()
            .with_connect_timeout(timeout)
            .with_timeout(timeout)
            .with_keep_alive(Duration::from_secs(2), timeout);
        if let Some(tls) = tls {
            options = options.with_tls(tls);
        }
        let client = tokio::time::timeout(timeout, Client::connect(endpoints, Some(options)))
            .await
            .map_err(|_| FleetError::Unreachable { endpoints: joined.clone(), why: "no answer".into() })?
            .map_err(|e| FleetError::Unreachable { endpoints: joined.clone(), why: e.to_string() })?;
        Ok(Store { client, timeout, endpoints: joined })
    }

    /// Runs `call` on a clone of the client (they share the connection), bounded by the timeout. A call that
    /// fails because a member is unreachable is tried again until the timeout: the client balances over every
    /// endpoint, and the next try may go to a member that answers.
    async fn call<T, F>(&self, what: &str, call: impl Fn(Client) -> F) -> Result<T, FleetError>
    where
        F: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        let deadline = tokio::time::Instant::now() + self.timeout;
        let mut last = String::from("no answer");
        loop {
            match tokio::time::timeout_at(deadline, call(self.client.clone())).await {
                Ok(Ok(value)) => return Ok(value),
                Ok(Err(err)) => {
                    let retry = matches!(&err, etcd_client::Error::GRpcStatus(status)
                        if status.code() == tonic_code_unavailable())
                        || matches!(err, etcd_client::Error::TransportError(_));
                    last = err.to_string();
                    if !retry {
                        break;
                    }
                }
                Err(_) => break,
            }
            if tokio::time::Instant::now() + RETRY_PAUSE >= deadline {
                break;
            }
            tokio::time::sleep(RETRY_PAUSE).await;
        }
        Err(FleetError::Etcd { what: what.to_owned(), why: last })
    }

    /// Every key under `prefix`.
    pub async fn range(&self, prefix: &str) -> Result<Vec<KeyValue>, FleetError> {
        let prefix = prefix.to_owned();
        let response = self
            .call("range", |mut client| {
                let prefix = prefix.clone();
                async move { client.get(prefix, Some(GetOptions::new().with_prefix())).await }
            })
            .await?;
        Ok(response.kvs().iter().map(key_value).collect())
    }

    /// The key, if it exists.
    pub async fn get(&self, key: &str) -> Result<Option<KeyValue>, FleetError> {
        let key = key.to_owned();
        let response = self
            .call("get", |mut client| {
                let key = key.clone();
                async move { client.get(key, None).await }
            })
            .await?;
        Ok(response.kvs().first().map(key_value))
    }

    /// Runs `txn`: whether its compares held (and its writes were applied).
    pub async fn txn(&self, txn: &Txn) -> Result<bool, FleetError> {
        let compares: Vec<etcd_client::Compare> = txn.compares.iter().map(compare).collect();
        let ops: Vec<TxnOp> = txn.success.iter().map(op).collect();
        let response = self
            .call("transaction", |mut client| {
                let request = etcd_client::Txn::new().when(compares.clone()).and_then(ops.clone());
                async move { client.txn(request).await }
            })
            .await?;
        Ok(response.succeeded())
    }

    /// A new lease of `ttl` (whole seconds, at least 1): its id.
    pub async fn grant(&self, ttl: Duration) -> Result<i64, FleetError> {
        let seconds = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let response =
            self.call("lease grant", |mut client| async move { client.lease_grant(seconds, None).await }).await?;
        Ok(response.id())
    }

    /// Renews `lease` once: its remaining time to live, 0 (or less) when etcd says it has expired. A stream that
    /// ends without an answer is an error (the connection), never an expiry.
    pub async fn keep_alive(&self, lease: i64) -> Result<i64, FleetError> {
        let ttl = self
            .call("lease keep-alive", |mut client| async move {
                let (mut keeper, mut stream) = client.lease_keep_alive(lease).await?;
                keeper.keep_alive().await?;
                Ok(stream.message().await?.map(|response| response.ttl()))
            })
            .await?;
        ttl.ok_or_else(|| FleetError::Etcd { what: "lease keep-alive".into(), why: "no answer".into() })
    }

    /// Ends `lease` now: its keys go at once.
    pub async fn revoke(&self, lease: i64) -> Result<(), FleetError> {
        self.call("lease revoke", |mut client| async move { client.lease_revoke(lease).await }).await?;
        Ok(())
    }

    /// Which members of the cluster answer, of how many (for `GET /v1/nodes` and logs).
    pub async fn members(&self) -> Result<usize, FleetError> {
        let response = self.call("member list", |mut client| async move { client.member_list().await }).await?;
        Ok(response.members().len())
    }
}

fn key_value(kv: &etcd_client::KeyValue) -> KeyValue {
    KeyValue {
        key: String::from_utf8_lossy(kv.key()).into_owned(),
        value: kv.value().to_vec(),
        create_revision: kv.create_revision(),
        mod_revision: kv.mod_revision(),
        version: kv.version(),
        lease: kv.lease(),
    }
}

/// One compare, as `strata_fleet::txn` maps it onto etcd's.
fn compare(compare: &Compare) -> etcd_client::Compare {
    match compare {
        Compare::Exists { key } => etcd_client::Compare::version(key.as_str(), CompareOp::Greater, 0),
        Compare::Missing { key } => etcd_client::Compare::create_revision(key.as_str(), CompareOp::Equal, 0),
        Compare::ModRevision { key, rev } => etcd_client::Compare::mod_revision(key.as_str(), CompareOp::Equal, *rev),
        Compare::Lease { key, lease } => etcd_client::Compare::lease(key.as_str(), CompareOp::Equal, *lease),
        Compare::Value { key, value } => etcd_client::Compare::value(key.as_str(), CompareOp::Equal, value.clone()),
    }
}

fn op(op: &Op) -> TxnOp {
    match op {
        Op::Put { key, value, lease } => {
            let options = lease.map(|lease| PutOptions::new().with_lease(lease));
            TxnOp::put(key.as_str(), value.clone(), options)
        }
        Op::Delete { key } => TxnOp::delete(key.as_str(), None),
    }
}
