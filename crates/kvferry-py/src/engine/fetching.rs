//! The engine's blocking fetches, for [`PyEngine`]'s Python methods (which keep the
//! signatures and documentation and call these): the delayed pull in one call, and
//! its two steps, stage and resolve. Each releases the GIL while it waits, and
//! waits on the library's transfer and drain fence as `get` does.

use pyo3::prelude::*;
use pyo3::types::PyList;

use super::{required, PyEngine, PyStaged};
use crate::block_ids::BlockIdsArg;
use crate::errors::ErrInfo;
use crate::region::PyRegion;
use crate::selection::{selection, PySelection};
use crate::transfer::PyTransfer;
use kvferry::ErrorCode;

impl PyEngine {
    pub(super) fn pull_blocking(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyList>,
        peer: String,
        region: &PyRegion,
        block_ids: Vec<BlockIdsArg>,
        timeout: f64,
        path: &str,
        select: Option<PySelection>,
    ) -> PyResult<usize> {
        let keys = Self::keys(keys)?;
        let dst = self.destination(region, block_ids, path, None, select)?;
        let t = required(timeout, "timeout")?;
        let _guard = self.handle().enter();
        // One fence for both steps, fired by the library once nothing writes `dst`:
        // a Ctrl-C returns only after the drain.
        let transfer = self
            .engine
            .start_pull(&peer, &keys, dst, tokio::time::Instant::now() + t);
        let fence = transfer.fence();
        let fut = transfer;
        let tr = PyTransfer::spawn(&self.waiting, peer.clone(), fence, fut);
        match tr.wait_outcome(py, None)? {
            Some(Ok(n)) => Ok(n),
            Some(Err(mut e)) => {
                e.op = Some("pull".into());
                Err(e.to_py(py))
            }
            None => unreachable!("waits without a bound"),
        }
    }

    pub(super) fn stage_blocking(
        &self,
        py: Python<'_>,
        peer: String,
        keys: &Bound<'_, PyList>,
        timeout: f64,
        select: Option<PySelection>,
    ) -> PyResult<PyStaged> {
        let keys = Self::keys(keys)?;
        let t = required(timeout, "timeout")?;
        let select = selection(select)?;
        let e = &self.engine;
        let h = py
            .detach(|| {
                self.handle()
                    .block_on(async {
                        let deadline = tokio::time::Instant::now() + t;
                        match &select {
                            None => e.stage(&peer, &keys, deadline).await,
                            Some(s) => e.stage_selected(&peer, &keys, s, deadline).await,
                        }
                    })
                    .map_err(|err| ErrInfo::from(&err).peer(&peer).op("stage"))
            })
            .map_err(PyErr::from)?;
        if h.chunks.is_empty() {
            return Err(
                ErrInfo::new(ErrorCode::NotFound, format!("{peer} holds none of the keys"))
                    .peer(&peer)
                    .op("stage")
                    .into(),
            );
        }
        Ok(PyStaged { handle: h })
    }

    pub(super) fn resolve_blocking(
        &self,
        py: Python<'_>,
        staged: &PyStaged,
        region: &PyRegion,
        block_ids: Vec<BlockIdsArg>,
        timeout: f64,
        path: &str,
        select: Option<PySelection>,
    ) -> PyResult<usize> {
        let dst = self.destination(region, block_ids, path, None, select)?;
        let t = required(timeout, "timeout")?;
        let h = staged.handle.clone();
        let peer = h.peer.clone();
        let _guard = self.handle().enter();
        // The library's fence: it fires once nothing writes `dst` (see `pull`).
        let transfer = self.engine.start_resolve(h, dst, tokio::time::Instant::now() + t);
        let fence = transfer.fence();
        let fut = transfer;
        let tr = PyTransfer::spawn(&self.waiting, peer, fence, fut);
        match tr.wait_outcome(py, None)? {
            Some(Ok(n)) => Ok(n),
            Some(Err(mut e)) => {
                e.op = Some("resolve".into());
                Err(e.to_py(py))
            }
            None => unreachable!("waits without a bound"),
        }
    }
}
