//! [`EtcdConfig`]: where the etcd directory connects and how it times its calls.

use std::time::Duration;

use super::super::DirectoryError;

/// Settings of an [`EtcdDirectory`](super::EtcdDirectory).
#[derive(Clone, Debug)]
pub struct EtcdConfig {
    /// etcd endpoints, as `http://host:port`.
    pub endpoints: Vec<String>,
    /// Records live under `<namespace>/peers/`.
    pub namespace: String,
    /// TTL of this process's registration lease (kept alive every TTL/3).
    pub ttl: Duration,
    /// Deadline of every etcd call.
    pub call_timeout: Duration,
    /// The view is stale when etcd confirmed nothing for this long.
    pub stale_after: Duration,
    /// First reconnect delay (doubled up to `backoff_max`).
    pub backoff_min: Duration,
    /// Longest reconnect delay.
    pub backoff_max: Duration,
}

impl EtcdConfig {
    /// Defaults (TTL 10 s, calls bounded by 3 s) for `endpoints` and `namespace`.
    pub fn new(endpoints: Vec<String>, namespace: impl Into<String>) -> EtcdConfig {
        EtcdConfig {
            endpoints,
            namespace: namespace.into(),
            ttl: Duration::from_secs(10),
            call_timeout: Duration::from_secs(3),
            stale_after: Duration::from_secs(3),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(2),
        }
    }

    /// Parses `etcd://HOST:PORT[,HOST:PORT...]` into endpoints.
    pub fn parse_url(url: &str) -> Result<Vec<String>, DirectoryError> {
        let rest = url.strip_prefix("etcd://").ok_or_else(|| {
            DirectoryError::InvalidConfig(format!("{url:?} is not an etcd://HOST:PORT[,HOST:PORT...] URL"))
        })?;
        let eps: Vec<String> = rest
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|hp| {
                let (h, p) = hp
                    .rsplit_once(':')
                    .ok_or_else(|| DirectoryError::InvalidConfig(format!("etcd endpoint {hp:?} needs HOST:PORT")))?;
                if h.is_empty() || p.parse::<u16>().is_err() {
                    return Err(DirectoryError::InvalidConfig(format!(
                        "etcd endpoint {hp:?} needs HOST:PORT with a port number"
                    )));
                }
                Ok(format!("http://{hp}"))
            })
            .collect::<Result<_, _>>()?;
        if eps.is_empty() {
            return Err(DirectoryError::InvalidConfig(format!("{url:?} names no etcd endpoint")));
        }
        Ok(eps)
    }

    /// Checks the settings.
    pub fn validate(&self) -> Result<(), DirectoryError> {
        let bad = |m: String| Err(DirectoryError::InvalidConfig(m));
        if self.endpoints.is_empty() {
            return bad("no etcd endpoint".into());
        }
        if self.namespace.is_empty() || self.namespace.contains('/') {
            return bad(format!(
                "namespace {:?} must be non-empty and contain no '/'",
                self.namespace
            ));
        }
        if self.ttl < Duration::from_secs(1) {
            return bad(format!(
                "lease TTL {:?} must be at least 1 s (etcd counts whole seconds)",
                self.ttl
            ));
        }
        for (n, d) in [
            ("call timeout", self.call_timeout),
            ("stale-after", self.stale_after),
            ("backoff", self.backoff_min),
        ] {
            if d.is_zero() {
                return bad(format!("{n} must be greater than zero"));
            }
        }
        Ok(())
    }

    /// The key prefix of peer records.
    pub fn prefix(&self) -> String {
        format!("{}/peers/", self.namespace)
    }

    /// The endpoints, for messages.
    pub fn endpoints_text(&self) -> String {
        self.endpoints.join(",")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_to_endpoints() {
        assert_eq!(
            EtcdConfig::parse_url("etcd://127.0.0.1:2379,10.0.0.2:2379").unwrap(),
            vec!["http://127.0.0.1:2379".to_string(), "http://10.0.0.2:2379".to_string()]
        );
        for bad in ["http://x:1", "etcd://", "etcd://host", "etcd://host:port", "etcd://:1"] {
            assert!(EtcdConfig::parse_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn namespaces_with_slashes_are_refused() {
        let mut c = EtcdConfig::new(vec!["http://127.0.0.1:1".into()], "a/b");
        assert!(c.validate().is_err());
        c.namespace = "fleet".into();
        c.validate().unwrap();
        assert_eq!(c.prefix(), "fleet/peers/");
    }
}
