//! The `Backend` trait of [`CudaBackend`]: every call prepared, then run by the dense engine.

use super::*;

impl CudaBackend {
    /// The dense engine (made and its kernels compiled on first use).
    pub(super) fn dense_engine(&self) -> Result<&DenseEngine> {
        if let Some(e) = self.dense.get() {
            return Ok(e);
        }
        let engine = DenseEngine::new(self.stream.clone())?
            .with_switches(self.engine_switches)
            .with_sparse_memory(self.sparse_memory.clone());
        // A concurrent first call may have won the race; either engine is equivalent.
        let _ = self.dense.set(engine);
        self.dense
            .get()
            .ok_or_else(|| CceError::backend(BACKEND, "dense engine not made"))
    }
}

/// Outputs of a dense-engine call: the forward's and the backward's, each when asked.
pub(super) type DenseOutputs = (
    Option<ForwardOutput<CudaTensor>>,
    Option<BackwardOutput<CudaTensor>>,
);

impl CudaBackend {
    /// The dense engine's call for `p`: the forward (unless `saved` is given, a backward from the
    /// saved state), and the backward when `upstream` is given; the engine is made on first use.
    pub(super) fn run_dense(
        &self,
        p: &Prepared,
        inputs: &Inputs<'_, CudaTensor>,
        opts: &Options,
        saved: Option<Saved<'_, CudaTensor>>,
        upstream: Option<&Upstream<'_, CudaTensor>>,
    ) -> Result<DenseOutputs> {
        let (mut fwd, mut bwd, on_device) =
            self.dense_engine()?
                .backend_run(&self.dense_call(p, inputs, opts), saved, upstream)?;
        let (lse, fs) = match fwd.as_mut() {
            Some(f) => (Some(&f.lse), Some(&mut f.stats)),
            None => (None, None),
        };
        self.finish_call(
            inputs,
            opts,
            p,
            lse,
            on_device,
            (fs, bwd.as_mut().map(|b| &mut b.stats)),
        )?;
        Ok((fwd, bwd))
    }

    /// The engine's view of a prepared call.
    pub(super) fn dense_call<'a>(
        &self,
        p: &'a Prepared,
        inputs: &'a Inputs<'a, CudaTensor>,
        opts: &'a Options,
    ) -> BackendCall<'a> {
        BackendCall {
            plan: &p.plan,
            give_way: p.give_way.as_ref().map(|(plan, o)| (plan, o)),
            n_valid: p.n_valid,
            classes: &p.classes,
            dl: p.dl.as_ref(),
            status: self.status_ptr(),
            inputs,
            opts,
            switches: self.path_switches(),
        }
    }
}

impl Backend for CudaBackend {
    type Buffer = CudaTensor;

    fn name(&self) -> &'static str {
        BACKEND
    }

    fn limits(&self) -> DeviceLimits {
        self.limits.clone()
    }

    fn upload(&self, host: &HostTensor) -> Result<CudaTensor> {
        let bytes = host.as_bytes();
        let mut slice = self.alloc_raw(bytes.len())?;
        if !bytes.is_empty() {
            let mut view = slice.slice_mut(..bytes.len());
            self.stream.memcpy_htod(bytes, &mut view).map_err(drv)?;
        }
        CudaTensor::from_slice(slice, host.dtype(), host.shape().to_vec())
    }

    fn download(&self, buf: &CudaTensor) -> Result<HostTensor> {
        let nbytes = buf.nbytes();
        let mut host = vec![0u8; nbytes];
        if nbytes > 0 {
            let view = buf.data.slice(..nbytes);
            self.stream.memcpy_dtoh(&view, &mut host).map_err(drv)?;
            self.stream.synchronize().map_err(drv)?;
        }
        HostTensor::from_bytes(buf.shape().to_vec(), buf.dtype(), &host)
    }

    fn forward(
        &self,
        inputs: &Inputs<'_, CudaTensor>,
        opts: &Options,
    ) -> Result<ForwardOutput<CudaTensor>> {
        let p = self.prepare(inputs, opts, None, false)?;
        let (fwd, _) = self.run_dense(&p, inputs, opts, None, None)?;
        fwd.ok_or_else(|| CceError::backend(BACKEND, "no forward output"))
    }

    fn backward(
        &self,
        inputs: &Inputs<'_, CudaTensor>,
        opts: &Options,
        saved: Saved<'_, CudaTensor>,
        upstream: &Upstream<'_, CudaTensor>,
    ) -> Result<BackwardOutput<CudaTensor>> {
        self.check_owned("lse", saved.lse)?;
        self.check_owned("rest_mass", saved.rest_mass)?;
        let p = self.prepare(inputs, opts, Some(upstream), false)?;
        saved.check(p.problem.n)?;
        let (_, bwd) = self.run_dense(&p, inputs, opts, Some(saved), Some(upstream))?;
        bwd.ok_or_else(|| CceError::backend(BACKEND, "no backward output"))
    }

    fn forward_backward(
        &self,
        inputs: &Inputs<'_, CudaTensor>,
        opts: &Options,
        upstream: &Upstream<'_, CudaTensor>,
    ) -> Result<(ForwardOutput<CudaTensor>, BackwardOutput<CudaTensor>)> {
        let p = self.prepare(inputs, opts, Some(upstream), true)?;
        // One call: the logits are not recomputed between the forward and the backward.
        let (fwd, bwd) = self.run_dense(&p, inputs, opts, None, Some(upstream))?;
        let fwd = fwd.ok_or_else(|| CceError::backend(BACKEND, "no forward output"))?;
        let bwd = bwd.ok_or_else(|| CceError::backend(BACKEND, "no backward output"))?;
        Ok((fwd, bwd))
    }
}
